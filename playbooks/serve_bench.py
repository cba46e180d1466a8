"""`serve-bench`: serve an EAGLE-3 model and benchmark it, as one job — one sweep point per setting.

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

from orchestrator.playbook import HealthCheck, Host, JobContext, Playbook, Prepared, other_nodes_only, quote

from .bench_serving import BenchSettings, bench_argv, bench_module
from .serve_eagle3 import (
    ServeEagle3Spec,
    engine_argv,
    health_check,
    installed_version,
    no_graph_flags,
    server_command,
)

WAIT = "wait_http.py"
JOBS = Path(__file__).parent / "jobs"
STOP_GRACE_S = 60  # SGLang shuts its scheduler processes down on SIGTERM; then SIGKILL


class ServeBenchSpec(ServeEagle3Spec):
    bench: BenchSettings = Field(default_factory=BenchSettings, description="the benchmark's settings")
    ready_timeout_s: float = Field(default=3600, gt=0, le=7 * 86400, description="seconds for the server to answer /health")


@dataclass(frozen=True)
class ServeBenchPrepared(Prepared):
    bench_module: list[str] = field(default_factory=list)


def shell(argv: list[str]) -> str:
    return " ".join(quote(a) for a in argv)


def script(spec: ServeBenchSpec, python: str, graph_flags: list[str], module: list[str]) -> str:
    """Server in the background, wait for it, benchmark, and stop the server whatever happened."""
    port = str(spec.port)
    url = f"http://127.0.0.1:{port}"
    server = server_command(spec, python, graph_flags)
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
        shell(bench_argv(python, spec.bench, url, module)),
    ]) + "\n"


class ServeBench(Playbook[ServeBenchSpec]):
    name = "serve-bench"
    Spec = ServeBenchSpec
    engine = "sglang"  # server and benchmark both print SGLang's formats
    multi_node = True

    def prepare(self, job: JobContext[ServeBenchSpec]) -> Prepared:
        job.remote.put((JOBS / WAIT).read_bytes(), posixpath.join(job.paths.root, WAIT))
        flags: list[str] = []
        if job.spec.debug:
            version = installed_version(job.remote, job.python)
            flags = [f for f in no_graph_flags(version) if f not in job.spec.extra_args]
        return ServeBenchPrepared(args=flags, bench_module=bench_module(job.remote, job.python, job.spec.bench.launcher))

    def command(self, job: JobContext[ServeBenchSpec], prepared: Prepared) -> str:
        module = prepared.bench_module if isinstance(prepared, ServeBenchPrepared) else []
        return script(job.spec, job.python, prepared.args, module)

    def engine_argv(self, spec: ServeBenchSpec) -> list[str] | None:
        return engine_argv(spec)

    def health(self, spec: ServeBenchSpec, host: Host) -> HealthCheck | None:
        return health_check(spec, host)
