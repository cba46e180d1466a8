"""`serve-bench` and `serve-bench-vllm`: serve a model and benchmark it, as one job — one sweep point per setting.

`serve-bench` is SGLang's EAGLE-3 server (every `serve-eagle3` field); `serve-bench-vllm` is vLLM's (every
`serve-vllm` field); both take a `bench` table and run the serving engine's own benchmark.

The job script starts the `serve-eagle3` server in the background (same flags, same debug patch set and
graphs-off spelling), waits until its /health answers, runs the `bench-serving` benchmark against it with
the spec's `bench` table, and stops the server on exit whatever happened (a failed benchmark, a
cancel). Server and benchmark write one log, so the run's metrics are both: the server's load time
and decode stats (`load_weight_s`, `accept_rate`, `gen_throughput`) and the benchmark's result block
(`output_throughput`, `median_ttft_ms`, `median_itl_ms`, `accept_len`). The job lives on the host: a
controller that dies leaves it running, and the resumed sweep watches it to its end.

On several nodes (`nodes` > 1) the server spans them as `serve-eagle3`'s does; the head (rank 0) runs the
script as above, every other node only its share of the server, in the foreground, until it is stopped.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from orchestrator.playbook import HealthCheck, Host, RunContext, Playbook, Prepared, other_nodes_only, quote

from . import serve_vllm
from .bench_serving import BenchSettings, Engine, bench_argv, bench_module, module_for, put_repeater, repeated
from .serve_eagle3 import (
    ServeEagle3Spec,
    engine_argv,
    health_check,
    installed_version,
    no_graph_flags,
    server_command,
)
from .serve_vllm import ServeVllmSpec

WAIT = "wait_http.py"
JOBS = Path(__file__).parent / "jobs"
STOP_GRACE_S = 60  # SGLang shuts its scheduler processes down on SIGTERM; then SIGKILL


class ServeBenchSpec(ServeEagle3Spec):
    bench: BenchSettings = Field(default_factory=BenchSettings, description="the benchmark's settings")
    ready_timeout_s: float = Field(default=3600, gt=0, le=7 * 86400, description="seconds for the server to answer /health")


class ServeBenchVllmSpec(ServeVllmSpec):
    bench: BenchSettings = Field(default_factory=BenchSettings, description="the benchmark's settings")
    ready_timeout_s: float = Field(default=3600, gt=0, le=7 * 86400, description="seconds for the server to answer /health")


@dataclass(frozen=True)
class ServeBenchPrepared(Prepared):
    bench_module: list[str] = field(default_factory=list)


def shell(argv: list[str]) -> str:
    return " ".join(quote(a) for a in argv)


def put_waiter(run: RunContext[ServeBenchSpec] | RunContext[ServeBenchVllmSpec]) -> None:
    """The script's waits (a free port, a server answering) run wait_http.py from the run dir; its repeats,
    repeat_bench.py."""
    run.remote.put((JOBS / WAIT).read_bytes(), posixpath.join(run.paths.root, WAIT))
    put_repeater(run, run.spec.bench)


def script(spec: ServeBenchSpec | ServeBenchVllmSpec, python: str, server: str, module: list[str],
           engine: Engine = "sglang") -> str:
    """Server in the background, wait for it, benchmark, and stop the server whatever happened."""
    port = str(spec.port)
    url = f"http://127.0.0.1:{port}"
    model = (spec.served_model_name or spec.model) if isinstance(spec, ServeBenchVllmSpec) else None
    # a node other than the head: its share of the server only (the API, and so the benchmark, is the head's)
    worker = [other_nodes_only(server)] if spec.nodes > 1 else []
    return "\n".join([
        f"{shell([python, WAIT, 'free', '127.0.0.1', port])} || exit 1",
        *worker,
        f"{server} &",
        "server=$!",
        (f'stop_server() {{ kill -TERM "$server" 2>/dev/null || return 0; for _ in $(seq {STOP_GRACE_S * 10}); do '
         'kill -0 "$server" 2>/dev/null || return 0; sleep 0.1; done; kill -KILL "$server" 2>/dev/null; }'),
        "trap stop_server EXIT",
        (f"{shell([python, WAIT, 'up', url + '/health', '--timeout', f'{spec.ready_timeout_s:g}'])} "
        '--pid "$server" || exit 1'),
        shell(repeated(bench_argv(python, spec.bench, url, module, engine, model), spec.bench.repeats,
                       spec.bench.warmup)),
    ]) + "\n"


class ServeBench(Playbook[ServeBenchSpec]):
    name = "serve-bench"
    Spec = ServeBenchSpec
    engine = "sglang"  # server and benchmark both print SGLang's formats
    multi_node = True

    def prepare(self, run: RunContext[ServeBenchSpec]) -> Prepared:
        put_waiter(run)
        # one look at the installed SGLang: how its log reads, and "graphs off" and the benchmark's module
        # in its spelling
        version = installed_version(run.remote, run.python)
        flags = [f for f in no_graph_flags(version) if f not in run.spec.extra_args] if run.spec.debug else []
        module = [] if run.spec.bench.launcher is not None else module_for(version)
        return ServeBenchPrepared(args=flags, engine_version=version, bench_module=module)

    def command(self, run: RunContext[ServeBenchSpec], prepared: Prepared) -> str:
        module = prepared.bench_module if isinstance(prepared, ServeBenchPrepared) else []
        return script(run.spec, run.python, server_command(run.spec, run.python, prepared.args), module)

    def engine_argv(self, spec: ServeBenchSpec) -> list[str] | None:
        return engine_argv(spec)

    def health(self, spec: ServeBenchSpec, host: Host) -> HealthCheck | None:
        return health_check(spec, host)


class ServeBenchVllm(Playbook[ServeBenchVllmSpec]):
    name = "serve-bench-vllm"
    Spec = ServeBenchVllmSpec
    engine = "vllm"  # server and benchmark both print vLLM's formats
    multi_node = True

    def prepare(self, run: RunContext[ServeBenchVllmSpec]) -> Prepared:
        put_waiter(run)
        return Prepared(args=bench_module(run.remote, run.python, run.spec.bench.launcher, "vllm"))

    def command(self, run: RunContext[ServeBenchVllmSpec], prepared: Prepared) -> str:
        server = serve_vllm.server_command(run.spec, run.python)
        return script(run.spec, run.python, server, prepared.args, "vllm")

    def engine_argv(self, spec: ServeBenchVllmSpec) -> list[str] | None:
        return serve_vllm.engine_argv(spec)

    def health(self, spec: ServeBenchVllmSpec, host: Host) -> HealthCheck | None:
        return serve_vllm.ServeVllm().health(spec, host)
