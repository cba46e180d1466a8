"""`bench-serving`: SGLang's serving benchmark against a ready `serve-eagle3` run or a URL.

The benchmark's result block becomes the run's metrics (the sglang log parser reads it); the server
run it measured is its `server` spec field.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.playbook import (
    SERVING_PHASES,
    FindRun,
    Host,
    JobContext,
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

SERVER_PLAYBOOKS = ("serve-eagle3",)
LEGACY_MODULE = "-m sglang.bench_serving"  # every version; a deprecated alias once the package has the new one
MODULE = "-m sglang.benchmark.serving"  # the package's own spelling from 0.5.15 on
MODULE_SINCE = (0, 5, 15)


MAX_FAILED_DOC = "share of requests that may fail: above it the run fails, up to it it is degraded"


class BenchServingSpec(RunSpec):
    server: int | None = Field(default=None, gt=0, le=2**53, description="id of a ready serve-eagle3 run on the same host")
    url: str | None = Field(default=None, pattern=r"^https?://[^\s/]+(/\S*)?$", description="server base URL")
    num_prompts: int = Field(default=200, gt=0, le=10_000_000)
    max_concurrency: int | None = Field(default=None, gt=0, le=1_000_000)
    dataset: str = Field(default="random-ids", pattern=r"^[A-Za-z0-9][\w\-]*$",
                         description="--dataset-name; random-ids needs no download (random samples ShareGPT, which "
                                     "SGLang fetches from the model hub: a GPU host without internet fails on it)")
    input_len: int | None = Field(default=None, gt=0, le=100_000_000, description="--random-input-len")
    output_len: int | None = Field(default=None, gt=0, le=100_000_000, description="--random-output-len")
    extra_args: list[str] = Field(default_factory=list, description="more benchmark flags, as given")
    launcher: str | None = Field(default=None, description="what follows python; default by SGLang version")
    max_failed_fraction: float = Field(default=0.0, ge=0, le=1, description=MAX_FAILED_DOC)
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
    dataset: str = Field(default="random-ids", pattern=r"^[A-Za-z0-9][\w\-]*$",
                         description="--dataset-name; random-ids needs no download")
    input_len: int | None = Field(default=None, gt=0, le=100_000_000, description="--random-input-len")
    output_len: int | None = Field(default=None, gt=0, le=100_000_000, description="--random-output-len")
    extra_args: list[str] = Field(default_factory=list, description="more benchmark flags, as given")
    launcher: str | None = Field(default=None, description="what follows python; default by SGLang version")
    max_failed_fraction: float = Field(default=0.0, ge=0, le=1, description=MAX_FAILED_DOC)

    @field_validator("launcher")
    @classmethod
    def _launcher(cls, text: str | None) -> str | None:
        if text is not None:
            split_launcher(text)
        return text


def bench_module(remote: Remote, python: str, launcher: str | None) -> list[str]:
    """The benchmark's module in the installed SGLang's spelling (nothing to add with a launcher given)."""
    if launcher is not None:
        return []
    return module_for(installed_version(remote, python))


def module_for(version: str | None) -> list[str]:
    """`-m sglang.benchmark.serving` from 0.5.15 on, the old module before it or when not known."""
    new = version is not None and bool(release(version)) and release(version) >= MODULE_SINCE
    return split_launcher(MODULE if new else LEGACY_MODULE)


def bench_argv(python: str, s: BenchSettings | BenchServingSpec, url: str, module: list[str]) -> list[str]:
    """The benchmark's command line against the server at `url`."""
    launcher = split_launcher(s.launcher) if s.launcher is not None else []
    args = ["--backend", "sglang", "--base-url", url, "--num-prompts", str(s.num_prompts), "--dataset-name", s.dataset]
    if s.max_concurrency is not None:
        args += ["--max-concurrency", str(s.max_concurrency)]
    if s.input_len is not None:
        args += ["--random-input-len", str(s.input_len)]
    if s.output_len is not None:
        args += ["--random-output-len", str(s.output_len)]
    return [python, *launcher, *module, *args, *s.extra_args]


def base_url(find_run: FindRun, spec: BenchServingSpec, host: Host) -> str:
    """The server's URL; a `server` run must be a running, ready server on the same host."""
    if spec.url is not None:
        return spec.url.rstrip("/")
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
    return f"http://127.0.0.1:{int(run.spec['port'])}"


class BenchServing(Playbook[BenchServingSpec]):
    name = "bench-serving"
    Spec = BenchServingSpec
    engine = "sglang"
    exclusive = False  # a client: the host and its GPUs stay the server's

    def check_inputs(self, spec: BenchServingSpec, host: Host, find_run: FindRun) -> None:
        base_url(find_run, spec, host)

    def prepare(self, job: JobContext[BenchServingSpec]) -> Prepared:
        return Prepared(args=bench_module(job.remote, job.python, job.spec.launcher))

    def command(self, job: JobContext[BenchServingSpec], prepared: Prepared) -> str:
        argv = bench_argv(job.python, job.spec, base_url(job.find_run, job.spec, job.host), prepared.args)
        return " ".join(quote(a) for a in argv)
