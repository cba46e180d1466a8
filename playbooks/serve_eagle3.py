"""`serve-eagle3`: an SGLang server with EAGLE-3 speculative decoding, watched until stopped.

On several nodes (`nodes` > 1) every node runs the same launch_server command with SGLang's rendezvous
(`--nnodes`, `--node-rank`, `--dist-init-addr` from the node's environment); `tp` is the total over all
nodes. Only the head (rank 0) serves the API and prints the ready line; the other nodes run their share of
the scheduler processes (recent SGLang answers /health there with a stand-in server once they are up).

`debug = true` adds the hidden-state debug patch set and turns CUDA graphs off (debug code in a model's
forward does not run under graph replay), in the spelling of the SGLang version on the host.
"""

from __future__ import annotations

import re
import shlex

from pydantic import Field, field_validator, model_validator

from orchestrator.playbook import (
    HealthCheck,
    Host,
    RunContext,
    Playbook,
    Prepared,
    Remote,
    RunSpec,
    http_probe,
    quote,
    rendezvous,
    rendezvous_args,
)

DEBUG_SET = "sglang-eagle3-hidden-debug"
LEGACY_NO_GRAPHS = ["--disable-cuda-graph"]  # before 0.5.14; deprecated from there
# 0.5.14 on: per phase, as the debug patch set requires (a contract test keeps the two the same)
NO_GRAPHS = ["--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled"]
HEALTH_GRACE_S = 120.0
# SGLang's /health runs a one-token generation from 0.5.5 (>= 1 s, up to ~20 s on a busy server)
HEALTH_TIMEOUT_S = 30.0
PER_PHASE_SINCE = (0, 5, 14)  # the first version whose server_args spell "graphs off" per phase

_VERSION_PY = (
    "import importlib.metadata as m, sys\n"
    "try:\n    print(m.version(sys.argv[1]))\n"
    "except m.PackageNotFoundError:\n    print('none')\n"
)


def split_launcher(text: str) -> list[str]:
    try:
        parts = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"cannot split: {exc}") from None
    if not parts:
        raise ValueError("empty")
    return parts


def installed_version(remote: Remote, python: str, package: str = "sglang") -> str | None:
    """The package's version as the host's python sees it, or None (not installed, no answer)."""
    res = remote.run_argv([python, "-c", _VERSION_PY, package], check=False, timeout=60)
    lines = res.stdout.strip().splitlines()
    found = lines[-1].strip() if res.ok and lines else ""
    return found if found and found != "none" else None


def release(version: str) -> tuple[int, ...]:
    """`0.5.5.post3` -> (0, 5, 5): the numeric release, enough to order engine versions."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def no_graph_flags(version: str | None) -> list[str]:
    """How the version spells "CUDA graphs off"; unknown versions get the debug patch set's spelling."""
    if version is not None and release(version) and release(version) < PER_PHASE_SINCE:
        return list(LEGACY_NO_GRAPHS)
    return list(NO_GRAPHS)


class ServeEagle3Spec(RunSpec):
    model: str = Field(min_length=1, description="target model path on the host")
    draft_model: str = Field(min_length=1, description="EAGLE-3 draft model path on the host")
    tp: int = Field(default=8, gt=0, le=1024, description="tensor parallel size")
    port: int = Field(default=30000, ge=1, le=65535)
    num_steps: int | None = Field(default=None, gt=0, le=1000, description="--speculative-num-steps")
    eagle_topk: int | None = Field(default=None, gt=0, le=1000, description="--speculative-eagle-topk")
    num_draft_tokens: int | None = Field(default=None, gt=0, le=100_000, description="--speculative-num-draft-tokens")
    mem_fraction: float | None = Field(default=None, gt=0, le=1, description="--mem-fraction-static")
    extra_args: list[str] = Field(default_factory=list, description="more launch_server flags, as given")
    launcher: str = Field(default="-m sglang.launch_server", description="what follows python (split like a shell)")
    debug: bool = Field(default=False, description=f"apply {DEBUG_SET} and turn CUDA graphs off")
    health_grace_s: float = Field(default=HEALTH_GRACE_S, gt=0, le=86400,
                                  description="seconds a ready server may fail /health before the run fails")
    health_timeout_s: float = Field(default=HEALTH_TIMEOUT_S, gt=0, le=3600,
                                    description="seconds one /health request may take (it generates a token)")

    @field_validator("launcher")
    @classmethod
    def _launcher(cls, text: str) -> str:
        split_launcher(text)
        return text

    @model_validator(mode="after")
    def _debug_patches(self) -> ServeEagle3Spec:
        if self.debug and DEBUG_SET not in self.patches:
            self.patches = [*self.patches, DEBUG_SET]
        return self


def server_args(spec: ServeEagle3Spec) -> list[str]:
    """launch_server's flags (without the ones that turn CUDA graphs off)."""
    args = ["--model-path", spec.model, "--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", spec.draft_model, "--tp-size", str(spec.tp), "--port", str(spec.port)]
    for flag, value in (("--speculative-num-steps", spec.num_steps), ("--speculative-eagle-topk", spec.eagle_topk),
                        ("--speculative-num-draft-tokens", spec.num_draft_tokens),
                        ("--mem-fraction-static", spec.mem_fraction)):
        if value is not None:
            args += [flag, str(value)]
    return args + list(spec.extra_args)


def engine_argv(spec: ServeEagle3Spec) -> list[str]:
    """The server's command line as a patch set's flag check sees it."""
    argv = [spec.python or "python", *split_launcher(spec.launcher), *server_args(spec)]
    if spec.debug:  # prepare() adds these (or the older spelling, for an older engine)
        argv += [f for f in no_graph_flags(None) if f not in argv]
    return argv + (rendezvous_args("sglang") if spec.nodes > 1 else [])


def server_command(spec: ServeEagle3Spec, python: str, graph_flags: list[str]) -> str:
    """launch_server's shell line; on several nodes with the rendezvous each node fills in from its environment."""
    argv = [python, *split_launcher(spec.launcher), *server_args(spec), *graph_flags]
    line = " ".join(quote(a) for a in argv)
    return f"{line} {rendezvous('sglang')}" if spec.nodes > 1 else line


def server_url(spec: ServeEagle3Spec, host: Host) -> str:
    """The server's address: SGLang listens on 127.0.0.1 unless `--host` in extra_args says otherwise
    (all interfaces: the host's address is the one to use)."""
    args = list(spec.extra_args)
    bind = next((a.split("=", 1)[1] for a in args if a.startswith("--host=")), None)
    if "--host" in args and args.index("--host") + 1 < len(args):
        bind = args[args.index("--host") + 1]
    if bind in ("0.0.0.0", "::", "[::]"):
        bind = host.address or ("127.0.0.1" if host.is_local else host.name)
    bind = bind or "127.0.0.1"
    return f"http://{f'[{bind}]' if ':' in bind else bind}:{spec.port}"


def health_check(spec: ServeEagle3Spec, host: Host) -> HealthCheck:
    return HealthCheck(http_probe(spec.port, spec.python or host.python, timeout_s=spec.health_timeout_s),
                       spec.health_grace_s)


class ServeEagle3(Playbook[ServeEagle3Spec]):
    name = "serve-eagle3"
    Spec = ServeEagle3Spec
    engine = "sglang"  # the sglang parser knows the ready line, so no ready_pattern
    multi_node = True

    def prepare(self, run: RunContext[ServeEagle3Spec]) -> Prepared:
        version = installed_version(run.remote, run.python)  # also how its decode line reads
        if not run.spec.debug:
            return Prepared(engine_version=version)
        return Prepared(args=[f for f in no_graph_flags(version) if f not in run.spec.extra_args],
                        engine_version=version)

    def command(self, run: RunContext[ServeEagle3Spec], prepared: Prepared) -> str:
        return server_command(run.spec, run.python, prepared.args)

    def engine_argv(self, spec: ServeEagle3Spec) -> list[str] | None:
        return engine_argv(spec)

    def health(self, spec: ServeEagle3Spec, host: Host) -> HealthCheck | None:
        return health_check(spec, host)

    def url(self, spec: ServeEagle3Spec, host: Host) -> str | None:
        return server_url(spec, host)
