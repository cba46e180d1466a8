"""`serve-vllm`: a vLLM OpenAI-compatible server, plain or with speculative decoding, watched until stopped.

The server is `vllm serve` through the host's python (`-m vllm.entrypoints.cli.main serve`), bound to
loopback unless `bind` says otherwise. It is ready when its log says `Application startup complete` and
`/health` (asked on the host) answers 200. `speculative_config` is vLLM's own table (`method` eagle3, ngram,
mtp, a draft `model`, `num_speculative_tokens` ...), passed as JSON; `num_speculative_tokens` on its own is
a shortcut into that table, so a sweep or a `--set` can vary it alone.

On a CPU host vLLM sizes its KV cache from `VLLM_CPU_KVCACHE_SPACE` (GiB) or `--kv-cache-memory-bytes`;
without either it takes nearly all the machine's memory, so `kv_cache_bytes` is worth setting there.

On several nodes (`nodes` > 1) every node runs the server with vLLM's multi-node "mp" backend (`--nnodes`,
`--node-rank`, `--master-addr`, `--master-port` from the node's environment); the nodes other than the head
run headless (their workers only); `tp` x `pp` spans all of them.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, field_validator, model_validator

from orchestrator.playbook import (
    HealthCheck,
    Host,
    RunContext,
    Playbook,
    Prepared,
    RunSpec,
    http_probe,
    quote,
    rendezvous,
    rendezvous_args,
)

from .serve_eagle3 import split_launcher

DEBUG_SET = "vllm-eagle3-hidden-debug"
HEADLESS = ["--headless"]  # a node other than the head: its workers only, no API server
HEALTH_GRACE_S = 120.0
HEALTH_TIMEOUT_S = 10.0  # vLLM's /health only asks the engine core whether it is alive


class ServeVllmSpec(RunSpec):
    model: str = Field(min_length=1, description="model path (or hub id) as the host sees it")
    served_model_name: str | None = Field(default=None, min_length=1, description="--served-model-name")
    port: int = Field(default=8000, ge=1, le=65535)
    bind: str = Field(default="127.0.0.1", pattern=r"^[0-9A-Za-z.:\-\[\]]+$",
                      description="--host: the address the server listens on (0.0.0.0: every interface)")
    tp: int = Field(default=1, gt=0, le=1024, description="--tensor-parallel-size (over all nodes)")
    pp: int = Field(default=1, gt=0, le=1024, description="--pipeline-parallel-size")
    dp: int = Field(default=1, gt=0, le=1024, description="--data-parallel-size")
    max_model_len: int | None = Field(default=None, gt=0, le=100_000_000, description="--max-model-len")
    dtype: str | None = Field(default=None, pattern=r"^[a-z0-9_]+$", description="--dtype")
    speculative_config: dict[str, Any] | None = Field(
        default=None, description="vLLM's --speculative-config as a table: method, model, num_speculative_tokens ...")
    num_speculative_tokens: int | None = Field(default=None, gt=0, le=1000,
                                               description="sets speculative_config.num_speculative_tokens")
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1, description="--gpu-memory-utilization")
    kv_cache_bytes: int | None = Field(default=None, gt=0, le=2**50,
                                       description="--kv-cache-memory-bytes (a CPU host: the KV cache's size)")
    enforce_eager: bool = Field(default=False, description="--enforce-eager: no CUDA graphs / torch.compile")
    max_num_seqs: int | None = Field(default=None, gt=0, le=1_000_000, description="--max-num-seqs: requests batched at once")
    max_num_batched_tokens: int | None = Field(default=None, gt=0, le=100_000_000,
                                               description="--max-num-batched-tokens: tokens per scheduler step")
    block_size: int | None = Field(default=None, gt=0, le=4096, description="--block-size: tokens per KV cache block")
    extra_args: list[str] = Field(default_factory=list, description="more `vllm serve` flags, as given")
    launcher: str = Field(default="-m vllm.entrypoints.cli.main serve", description="what follows python (split like a shell)")
    debug: bool = Field(default=False, description=f"apply {DEBUG_SET} (hidden-state shapes on the EAGLE-3 path) "
                                                   "and run eagerly (the debug code cannot run in a compiled graph)")
    health_grace_s: float = Field(default=HEALTH_GRACE_S, gt=0, le=86400,
                                  description="seconds a ready server may fail /health before the run fails")
    health_timeout_s: float = Field(default=HEALTH_TIMEOUT_S, gt=0, le=3600, description="seconds one /health request may take")

    @field_validator("launcher")
    @classmethod
    def _launcher(cls, text: str) -> str:
        split_launcher(text)
        return text

    @field_validator("speculative_config")
    @classmethod
    def _speculative(cls, table: dict[str, Any] | None) -> dict[str, Any] | None:
        if table is not None:
            if not table.get("method") and not table.get("model"):
                raise ValueError("needs a method (eagle3, ngram, mtp ...) or a draft model")
            json.dumps(table)  # a TOML table always is; a --set JSON value too
        return table

    @model_validator(mode="after")
    def _settle(self) -> ServeVllmSpec:
        if self.num_speculative_tokens is not None:
            if self.speculative_config is None:
                raise ValueError("num_speculative_tokens needs a speculative_config (its method or draft model)")
            self.speculative_config = {**self.speculative_config, "num_speculative_tokens": self.num_speculative_tokens}
        if self.debug:
            self.enforce_eager = True
            if DEBUG_SET not in self.patches:
                self.patches = [*self.patches, DEBUG_SET]
        return self


def server_args(spec: ServeVllmSpec) -> list[str]:
    """`vllm serve`'s arguments: the model, then its flags."""
    args = [spec.model, "--host", spec.bind, "--port", str(spec.port)]
    for flag, value in (("--served-model-name", spec.served_model_name), ("--max-model-len", spec.max_model_len),
                        ("--dtype", spec.dtype), ("--gpu-memory-utilization", spec.gpu_memory_utilization),
                        ("--kv-cache-memory-bytes", spec.kv_cache_bytes), ("--max-num-seqs", spec.max_num_seqs),
                        ("--max-num-batched-tokens", spec.max_num_batched_tokens), ("--block-size", spec.block_size)):
        if value is not None:
            args += [flag, str(value)]
    for flag, size in (("--tensor-parallel-size", spec.tp), ("--pipeline-parallel-size", spec.pp),
                       ("--data-parallel-size", spec.dp)):
        if size != 1:
            args += [flag, str(size)]
    if spec.speculative_config is not None:
        args += ["--speculative-config", json.dumps(spec.speculative_config, sort_keys=True)]
    if spec.enforce_eager:
        args.append("--enforce-eager")
    return args + list(spec.extra_args)


def engine_argv(spec: ServeVllmSpec) -> list[str]:
    """The server's command line as a patch set's flag check sees it."""
    argv = [spec.python or "python", *split_launcher(spec.launcher), *server_args(spec)]
    if spec.nodes > 1:
        argv += ["--distributed-executor-backend", "mp", *rendezvous_args("torchrun")]
    return argv


def server_command(spec: ServeVllmSpec, python: str) -> str:
    """The server's shell line; on several nodes each node fills the rendezvous in from its environment and
    every node but the head runs headless."""
    line = " ".join(quote(a) for a in [python, *split_launcher(spec.launcher), *server_args(spec)])
    if spec.nodes == 1:
        return line
    headless = " ".join(HEADLESS)
    return (f"{line} --distributed-executor-backend mp {rendezvous('torchrun')}"
            f' $([ "$NODE_RANK" != 0 ] && echo {headless})')


def server_url(spec: ServeVllmSpec, host: Host) -> str:
    """Where the server answers as the host sees it (every interface: the host's own address)."""
    bind = spec.bind.strip("[]")
    if bind in ("0.0.0.0", "::"):
        bind = host.address or ("127.0.0.1" if host.is_local else host.name)
    return f"http://{f'[{bind}]' if ':' in bind else bind}:{spec.port}"


class ServeVllm(Playbook[ServeVllmSpec]):
    name = "serve-vllm"
    Spec = ServeVllmSpec
    engine = "vllm"  # the vllm parser knows the ready line, so no ready_pattern
    multi_node = True

    def command(self, run: RunContext[ServeVllmSpec], prepared: Prepared) -> str:
        return server_command(run.spec, run.python)

    def engine_argv(self, spec: ServeVllmSpec) -> list[str] | None:
        return engine_argv(spec)

    def health(self, spec: ServeVllmSpec, host: Host) -> HealthCheck | None:
        return HealthCheck(http_probe(spec.port, spec.python or host.python, timeout_s=spec.health_timeout_s),
                           spec.health_grace_s)

    def url(self, spec: ServeVllmSpec, host: Host) -> str | None:
        return server_url(spec, host)
