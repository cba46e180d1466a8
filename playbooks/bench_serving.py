"""`bench-serving`: the serving benchmark of whichever engine serves, against a ready server run or a URL.

Against a `serve-eagle3` run (or `engine = "sglang"`) it is SGLang's benchmark module; against a
`serve-vllm` run (or `engine = "vllm"`) it is `vllm bench serve --backend vllm`, which also needs the
served model's name (`model`: the server run's, else give it) for its tokenizer and requests. The
benchmark's result block becomes the run's metrics; the server run it measured is its `server` spec field.
By default the benchmark runs with the server run's python (the engine's environment).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.playbook import (
    SERVING_PHASES,
    FindRun,
    Host,
    RunContext,
    NotFound,
    Playbook,
    Prepared,
    Remote,
    RunSpec,
    Status,
    UsageError,
    quote,
)

from .serve_eagle3 import installed_version, release, split_launcher

Engine = Literal["sglang", "vllm"]
SERVER_PLAYBOOKS: dict[str, Engine] = {"serve-eagle3": "sglang", "serve-vllm": "vllm"}
VLLM_MODULE = "-m vllm.entrypoints.cli.main bench serve"
# What each engine's benchmark reads without a download: SGLang's `random` samples ShareGPT from the hub,
# `random-ids` does not; vLLM's `random` draws token ids from the model's own tokenizer.
DEFAULT_DATASET: dict[Engine, str] = {"sglang": "random-ids", "vllm": "random"}
LEGACY_MODULE = "-m sglang.bench_serving"  # every version; a deprecated alias once the package has the new one
MODULE = "-m sglang.benchmark.serving"  # the package's own spelling from 0.5.15 on
MODULE_SINCE = (0, 5, 15)


MAX_FAILED_DOC = ("share of requests that may fail: above it the run fails and its numbers are invalid, up to it "
                  "it is degraded")
REPEATS_DOC = "benchmarks run one after another against the one server, each recorded (step = repeat)"
WARMUP_DOC = "benchmarks run first and not recorded (their output goes to warmup.log in the run dir)"
# (repeats and warm-ups run in one process: jobs/repeat_bench.py)


class BenchServingSpec(RunSpec):
    server: int | None = Field(default=None, gt=0, le=2**53,
                               description="id of a ready serve-eagle3 or serve-vllm run on the same host")
    url: str | None = Field(default=None, pattern=r"^https?://[^\s/]+(/\S*)?$", description="server base URL")
    engine: Engine | None = Field(default=None, description="whose benchmark: the server run's engine (a url: sglang)")
    model: str | None = Field(default=None, min_length=1, description="the served model (vLLM; default: the server run's)")
    num_prompts: int = Field(default=200, gt=0, le=10_000_000)
    max_concurrency: int | None = Field(default=None, gt=0, le=1_000_000)
    dataset: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][\w\-]*$",
                                description="--dataset-name; default the one that needs no download: random-ids for "
                                            "SGLang (its random samples ShareGPT from the hub), random for vLLM")
    input_len: int | None = Field(default=None, gt=0, le=100_000_000, description="--random-input-len")
    output_len: int | None = Field(default=None, gt=0, le=100_000_000, description="--random-output-len")
    extra_args: list[str] = Field(default_factory=list, description="more benchmark flags, as given")
    launcher: str | None = Field(default=None, description="what follows python; default by SGLang version")
    max_failed_fraction: float = Field(default=0.0, ge=0, le=1, description=MAX_FAILED_DOC)
    repeats: int = Field(default=1, ge=1, le=1000, description=REPEATS_DOC)
    warmup: int = Field(default=0, ge=0, le=1000, description=WARMUP_DOC)
    cleanup: bool = False  # a client: the GPUs belong to the server it measures

    @field_validator("launcher")
    @classmethod
    def _launcher(cls, text: str | None) -> str | None:
        if text is not None:
            split_launcher(text)
        return text

    @model_validator(mode="after")
    def _one_target(self) -> BenchServingSpec:
        if (self.server is None) == (self.url is None):
            raise ValueError("give exactly one of server (a run id) and url")
        return self


class BenchSettings(BaseModel):
    """The benchmark's own settings, shared by `bench-serving` and the `bench` table of `serve-bench`."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_prompts: int = Field(default=200, gt=0, le=10_000_000)
    max_concurrency: int | None = Field(default=None, gt=0, le=1_000_000)
    dataset: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][\w\-]*$",
                                description="--dataset-name; default random-ids (SGLang) or random (vLLM): no download")
    input_len: int | None = Field(default=None, gt=0, le=100_000_000, description="--random-input-len")
    output_len: int | None = Field(default=None, gt=0, le=100_000_000, description="--random-output-len")
    extra_args: list[str] = Field(default_factory=list, description="more benchmark flags, as given")
    launcher: str | None = Field(default=None, description="what follows python; default by SGLang version")
    max_failed_fraction: float = Field(default=0.0, ge=0, le=1, description=MAX_FAILED_DOC)
    repeats: int = Field(default=1, ge=1, le=1000, description=REPEATS_DOC)
    warmup: int = Field(default=0, ge=0, le=1000, description=WARMUP_DOC)

    @field_validator("launcher")
    @classmethod
    def _launcher(cls, text: str | None) -> str | None:
        if text is not None:
            split_launcher(text)
        return text


REPEAT = "repeat_bench.py"
JOBS = Path(__file__).parent / "jobs"


def repeated(argv: list[str], repeats: int, warmup: int) -> list[str]:
    """The benchmark's command line run `warmup` times unrecorded, then `repeats` times into the log (each a
    result block of its own), in one process of the engine's python (jobs/repeat_bench.py, in the run dir):
    its CLI is imported once, not once a repeat. One run is the command line as it is."""
    if repeats == 1 and warmup == 0:
        return argv
    return [argv[0], REPEAT, str(repeats), str(warmup), *argv[1:]]


def put_repeater(run: RunContext[Any], settings: BenchSettings | BenchServingSpec) -> None:
    """The repeats' runner goes to the run dir when there is more than one run."""
    if settings.repeats > 1 or settings.warmup:
        run.remote.put((JOBS / REPEAT).read_bytes(), posixpath.join(run.paths.root, REPEAT))


def bench_module(remote: Remote, python: str, launcher: str | None, engine: Engine = "sglang") -> list[str]:
    """The benchmark's module in the installed engine's spelling (nothing to add with a launcher given)."""
    if launcher is not None:
        return []
    if engine == "vllm":
        return split_launcher(VLLM_MODULE)
    return module_for(installed_version(remote, python))


def module_for(version: str | None) -> list[str]:
    """`-m sglang.benchmark.serving` from 0.5.15 on, the old module before it or when not known."""
    new = version is not None and bool(release(version)) and release(version) >= MODULE_SINCE
    return split_launcher(MODULE if new else LEGACY_MODULE)


def bench_argv(python: str, s: BenchSettings | BenchServingSpec, url: str, module: list[str],
               engine: Engine = "sglang", model: str | None = None) -> list[str]:
    """The benchmark's command line against the server at `url`."""
    launcher = split_launcher(s.launcher) if s.launcher is not None else []
    args = ["--backend", engine, "--base-url", url, "--num-prompts", str(s.num_prompts),
            "--dataset-name", s.dataset or DEFAULT_DATASET[engine]]
    if model is not None:
        args += ["--model", model]
    if s.max_concurrency is not None:
        args += ["--max-concurrency", str(s.max_concurrency)]
    if s.input_len is not None:
        args += ["--random-input-len", str(s.input_len)]
    if s.output_len is not None:
        args += ["--random-output-len", str(s.output_len)]
    return [python, *launcher, *module, *args, *s.extra_args]


@dataclass(frozen=True)
class Target:
    """What the benchmark measures: the server's URL and engine, the served model, the engine's python."""

    url: str
    engine: Engine
    model: str | None
    python: str | None


def target(find_run: FindRun, spec: BenchServingSpec, host: Host) -> Target:
    """The server to measure; a `server` run must be a running, ready server on the same host."""
    if spec.url is not None:
        engine = spec.engine or "sglang"
        if engine == "vllm" and spec.model is None:
            raise UsageError("model: vLLM's benchmark needs the served model's name (--set model=...)")
        return Target(spec.url.rstrip("/"), engine, spec.model if engine == "vllm" else None, None)
    try:
        run = find_run(int(spec.server or 0))
    except NotFound:
        raise UsageError(f"server: no run {spec.server}") from None
    where = f"server: run {run.id} ({run.playbook} on {run.host}, {run.status}, {run.phase})"
    if run.playbook not in SERVER_PLAYBOOKS:
        raise UsageError(f"{where} is not a server run")
    if run.host != host.name:
        raise UsageError(f"{where} is not on {host.name}")
    if run.status is not Status.RUNNING or run.phase not in SERVING_PHASES:
        raise UsageError(f"{where} is not a running, ready server")
    engine = SERVER_PLAYBOOKS[run.playbook]
    if spec.engine is not None and spec.engine != engine:
        raise UsageError(f"engine: run {run.id} is a {engine} server, not {spec.engine}")
    model = (spec.model or run.spec.get("served_model_name") or run.spec.get("model")) if engine == "vllm" else None
    return Target(f"http://127.0.0.1:{int(run.spec['port'])}", engine, model, run.spec.get("python"))


class BenchServing(Playbook[BenchServingSpec]):
    name = "bench-serving"
    Spec = BenchServingSpec
    engine = "sglang"
    exclusive = False  # a client: the host and its GPUs stay the server's

    def check_inputs(self, spec: BenchServingSpec, host: Host, find_run: FindRun) -> None:
        target(find_run, spec, host)

    def prepare(self, run: RunContext[BenchServingSpec]) -> Prepared:
        t = target(run.find_run, run.spec, run.host)
        put_repeater(run, run.spec)
        return Prepared(args=bench_module(run.remote, self.python(run, t), run.spec.launcher, t.engine))

    def command(self, run: RunContext[BenchServingSpec], prepared: Prepared) -> str:
        t = target(run.find_run, run.spec, run.host)
        argv = bench_argv(self.python(run, t), run.spec, t.url, prepared.args, t.engine, t.model)
        return " ".join(quote(a) for a in repeated(argv, run.spec.repeats, run.spec.warmup))

    def log_engine(self, spec: BenchServingSpec) -> str | None:
        # unset, the server run's engine decides, which the spec alone does not say: the parser tells by the log
        return spec.engine

    @staticmethod
    def python(run: RunContext[BenchServingSpec], t: Target) -> str:
        """The spec's python, else the server run's (its engine's environment), else the host's."""
        return run.spec.python or t.python or run.host.python
