"""What a running engine's log means for its run (in process): a clean stop is no crash, a benchmark with
failed requests is no success, a burst of requests is no stall, an idle server's throughput headline is what
it served at, a server's address comes from its log, and an engine version names what its lines mean."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from recording import Clock, FakeExecutor, new_run

from orchestrator.config.hosts import Host, local_host
from orchestrator.host import stall
from orchestrator.host.launch import JobState
from orchestrator.logparse import LogParser, assumption, inspect_file
from orchestrator.runflow.context import failed_bound
from orchestrator.runflow.outcome import logged_url
from orchestrator.runflow.recorder import Recorder, WatchOptions
from orchestrator.store import Store, summaries
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.store.shapes import run_document

LOGS = Path(__file__).parent.parent / "logs"


def watched(tmp_path: Path, **opts: Any) -> tuple[Store, Recorder, FakeExecutor, Clock]:
    store = Store(tmp_path / "orch.db")
    run_id = new_run(store, tmp_path, "job")
    clock, executor = Clock(), FakeExecutor()
    options = WatchOptions(poll_min=30, poll_max=600, **opts)
    return store, Recorder(store, run_id, executor, options, clock=clock), executor, clock  # type: ignore[arg-type]


def push(w: Recorder, data: bytes, exit_code: int | None = None) -> bool:
    """The next bytes of the job's log, as its host's agent pushes them; with an exit code, its end."""
    return w.absorb(JobState(alive=exit_code is None, exit_code=exit_code, size=w.offset + len(data),
                             offset=w.offset, data=data, started_at=999_000.0,
                             ended_at=999_100.0 if exit_code is not None else None))


def test_a_job_that_stops_its_own_server_is_not_failed_by_the_stop(tmp_path: Path) -> None:
    """vLLM may log an EngineDeadError traceback after its shutdown was asked for: that is how it stopped."""
    server = (LOGS / "vllm_0_32_cpu_clean_stop_engine_dead.log").read_bytes()
    store, w, executor, clock = watched(tmp_path)
    assert not push(w, server)
    clock.now += 5  # far past the grace a fatal line gives a living process
    assert not push(w, b"")
    assert w.status is Status.RUNNING and executor.kills == 0
    assert push(w, b"wrote 16 files\n", exit_code=0)
    run = store.get_run(w.run_id)
    assert run.status is Status.SUCCEEDED and run.error is None
    assert not [e for e in store.events(w.run_id) if e["kind"] == "error"]


def test_a_stopped_server_reads_as_stopped_not_failed() -> None:
    """What `orch stop`'s last read of the log sees: the stop's lines, no error, the phase it served in."""
    p = LogParser()
    p.feed((LOGS / "vllm_0_32_cpu_clean_stop_engine_dead.log").read_bytes())
    p.finish(exit_code=None)  # stopped by a signal: no exit code written
    assert p.error is None and p.phase == "running" and p.stopping
    # a traceback the stop cut short is no cause either
    q = LogParser()
    q.feed(b"[2026-11-02 08:00:00] SIGTERM received. signum=15 frame=None. Draining requests and shutting down...\n"
           b"[2026-11-02 08:00:01] SIGQUIT received. signum=None, frame=None. It usually means one child failed.\n"
           b"Traceback (most recent call last):\n  File \"/x/sglang/srt/managers/scheduler.py\", line 9, in run\n")
    q.finish()
    assert q.error is None and q.phase != "failed"


def test_a_killed_engine_core_is_named_with_its_own_hint() -> None:
    got = inspect_file(LOGS / "vllm_0_32_cpu_engine_core_sigkill.log")
    err = got["error"]
    assert got["phase"] == "failed" and err["kind"] == "killed" and err["exception"] is None
    assert "engine core exited unexpectedly" in err["message"]
    assert err["chain"][0].startswith("vllm.v1.engine.exceptions.EngineDeadError")  # its consequence
    assert err["hint"].startswith("vLLM's engine core process was killed")


def test_a_stop_of_the_whole_group_is_no_killed_engine_core() -> None:
    """`orch stop` signals the server's process group: its engine core may go a moment before the API server's
    own handler says a shutdown was asked for."""
    lines = (LOGS / "vllm_0_32_cpu_engine_core_sigkill.log").read_text().splitlines(keepends=True)
    signalled = "(APIServer pid=8120) INFO 12-06 05:11:19 [launcher.py:101] [shutdown] API server: shutdown triggered\n"
    p = LogParser()
    p.feed("".join([*lines[:6], signalled, *lines[6:]]).encode())
    p.finish()
    assert p.error is None and p.phase == "running"


def test_a_stop_after_the_killed_core_failed_its_requests_leaves_the_kill_named() -> None:
    """The engine core was killed, its requests failed with EngineDeadError, then the server's group was
    stopped (by orch, for that fatal line): the signal's line does not turn the crash into a stop."""
    lines = (LOGS / "vllm_0_32_cpu_engine_core_sigkill.log").read_text().splitlines(keepends=True)
    signalled = "(APIServer pid=8120) INFO 12-06 05:11:20 [launcher.py:101] [shutdown] API server: shutdown triggered\n"
    p = LogParser()
    p.feed("".join([*lines[:26], signalled, *lines[26:]]).encode())
    p.finish()
    assert p.phase == "failed" and p.error is not None and p.error.kind == "killed"
    assert "engine core exited unexpectedly" in p.error.message


BENCH = (LOGS / "vllm_bench_serve_failed_requests.log").read_bytes()


def test_a_benchmark_with_failed_requests_fails(tmp_path: Path) -> None:
    store, w, _, _ = watched(tmp_path)
    assert push(w, BENCH, exit_code=0)  # `vllm bench serve` exits 0 whatever failed
    run = store.get_run(w.run_id)
    assert run.status is Status.FAILED and run.exit_code == 0 and run.phase == "failed"
    assert run.reason == "141 of 200 benchmark requests failed (max_failed_fraction 0)"


def test_failed_requests_within_the_bound_are_degraded(tmp_path: Path) -> None:
    store, w, _, _ = watched(tmp_path, max_failed_fraction=0.75)
    assert push(w, BENCH, exit_code=0)
    run = store.get_run(w.run_id)
    assert run.status is Status.SUCCEEDED
    degraded = [e["message"] for e in store.events(w.run_id) if e["kind"] == "degraded"]
    assert degraded == ["141 of 200 benchmark requests failed: within max_failed_fraction 0.75"]


def test_a_benchmark_without_failures_succeeds(tmp_path: Path) -> None:
    store, w, _, _ = watched(tmp_path)
    assert push(w, BENCH.replace(b"Successful requests:                     59",
                                 b"Successful requests:                     200")
                .replace(b"Failed requests:                         141", b"Failed requests:                         0"),
                exit_code=0)
    assert store.get_run(w.run_id).status is Status.SUCCEEDED


def test_the_bound_comes_from_the_spec_or_its_bench_table() -> None:
    from playbooks.bench_serving import BenchServingSpec
    from playbooks.serve_bench import ServeBenchSpec

    assert failed_bound(BenchServingSpec(url="http://127.0.0.1:8000")) == 0.0
    assert failed_bound(BenchServingSpec(url="http://127.0.0.1:8000", max_failed_fraction=0.1)) == 0.1
    spec = ServeBenchSpec.model_validate({"model": "m", "draft_model": "d", "bench": {"max_failed_fraction": 0.2}})
    assert failed_bound(spec) == 0.2


def test_a_burst_of_requests_is_no_stall() -> None:
    """A benchmark's bar at 20 requests/s goes 1.9 s without an update between waves of completions."""
    bar = {"label": "", "done": 39, "total": 200, "rate_per_s": 20.0}
    assert stall.is_stalled(bar, progress_at=100.0, started_at=90.0, now=101.9, factor=5, floor_s=1.0) is None
    assert stall.is_stalled(bar, progress_at=100.0, started_at=90.0, now=106.0, factor=5, floor_s=1.0) == 6.0
    slow = {"label": "shards", "done": 3, "total": 86, "rate_per_s": 0.05}  # 20 s a shard: 5 of them
    assert stall.is_stalled(slow, progress_at=100.0, started_at=0.0, now=190.0, factor=5, floor_s=1.0) is None
    assert stall.is_stalled(slow, progress_at=100.0, started_at=0.0, now=201.0, factor=5, floor_s=1.0) == 101.0


def test_an_idle_servers_throughput_headline_is_what_it_served_at(tmp_path: Path) -> None:
    assert summaries.headline("gen_throughput", [0.0, 64.0, 0.0, 48.0, 0.0]) == 56.0
    assert summaries.headline("gen_throughput", [0.0, 0.0]) == 0.0  # never worked
    assert summaries.headline("output_throughput", [10.0, 0.0]) == 0.0  # no idle lines: the latest
    store = Store(tmp_path / "orch.db")
    run_id = store.create_run("command", "local", {"cmd": "serve"})
    p = LogParser()
    samples = p.feed((LOGS / "vllm_0_32_cpu_clean_stop_engine_dead.log").read_bytes())
    store.add_metrics(run_id, [(m.name, m.value, m.line) for m in samples], ts=1.0)
    assert p.metrics["gen_throughput"] == 0.0  # the log's last word: vLLM's idle line
    assert store.headline_metrics(run_id) == {"gen_throughput": 51.2, "load_weight_s": 0.02}
    # `orch status` shows it while the server serves; an ended run shows its latest values
    for status in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, status)
    store.update_run(run_id, phase="running")
    assert run_document(store, store.get_run(run_id))["metrics"]["gen_throughput"] == 51.2
    transition(store, run_id, Status.CANCELLED, "stopped by user")
    assert run_document(store, store.get_run(run_id))["metrics"]["gen_throughput"] == 0.0


def test_the_target_models_load_is_the_runs() -> None:
    for name, seconds in (("vllm_0_32_cpu_eagle3_draft_loads_second.log", 0.03),
                          ("vllm_0_32_cpu_hidden_states_extractor_load.log", 0.02)):
        p = LogParser()
        samples = p.feed((LOGS / name).read_bytes())
        assert [m.value for m in samples if m.name == "load_weight_s"] == [seconds]  # the draft's is no sample
        assert p.progress is not None and (p.progress.done, p.progress.total) == (4, 4)
    # a new load in the same log (the server started again) is the target's again
    p = LogParser()
    twice = (LOGS / "vllm_0_32_cpu_eagle3_draft_loads_second.log").read_bytes()
    samples = p.feed(twice + twice.replace(b"0.03 seconds", b"0.05 seconds"))
    assert [m.value for m in samples if m.name == "load_weight_s"] == [0.03, 0.05]


def test_a_vllm_servers_address_comes_from_its_log() -> None:
    p = LogParser()
    p.feed((LOGS / "vllm_0_32_cpu_clean_stop_engine_dead.log").read_bytes())
    assert p.url == "http://127.0.0.1:28011"
    q = LogParser()
    q.feed((LOGS / "vllm_0_32_cpu_eagle3_draft_loads_second.log").read_bytes())
    assert q.url == "http://0.0.0.0:28015"

    class Shown:
        parser_state = q.to_dict()

    host = Host(name="gpu01", address="10.1.2.3")
    assert logged_url(Shown(), host) == "http://10.1.2.3:28015"  # type: ignore[arg-type]
    assert logged_url(Shown(), local_host(Path("/tmp"))) == "http://127.0.0.1:28015"  # type: ignore[arg-type]
    Shown.parser_state = {}
    assert logged_url(Shown(), host) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("name, words", [
    ("vllm_0_32_cpu_kv_cache_too_small.log", "VLLM_CPU_KVCACHE_SPACE"),
    ("vllm_0_32_cpu_memory_refusal.log", "VLLM_CPU_KVCACHE_SPACE"),
    ("vllm_0_32_cpu_no_memory_for_cache_blocks.log", "VLLM_CPU_KVCACHE_SPACE"),
    ("vllm_0_32_missing_model_dir.log", "no such model directory"),
])
def test_hints_fit_the_host_and_the_cause(name: str, words: str) -> None:
    hint = inspect_file(LOGS / name)["error"]["hint"]
    assert words in hint
    assert "nvidia-smi" not in hint and "GPUs" not in hint and "tensor parallel" not in hint


def test_a_validation_error_keeps_its_reason() -> None:
    p = LogParser()
    p.feed(b"Traceback (most recent call last):\n"
           b"  File \"/v/bin/vllm\", line 10, in <module>\n    sys.exit(main())\n"
           b"pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
           b"  Value error, User-specified max_model_len (4096) is greater than the derived max_model_len "
           b"(max_position_embeddings=2048.0 or model_max_length=None in model's config.json). [type=value_error]\n"
           b"    For further information visit https://errors.pydantic.dev/2.12/v/value_error\n"
           b"INFO:     shell exited\n")
    p.finish(exit_code=1)
    assert p.error is not None and p.error.message == (
        "1 validation error for ModelConfig: Value error, User-specified max_model_len (4096) is greater than the "
        "derived max_model_len (max_position_embeddings=2048.0 or model_max_length=None in model's config.json). "
        "[type=value_error]")
    assert p.error.hint is not None and p.error.hint.startswith("--max-model-len exceeds the model's context")


def test_a_speculators_client_error_is_not_an_unreachable_server() -> None:
    hint = inspect_file(LOGS / "speculators_0_9_client_type_error_aborts.log")["error"]["hint"]
    assert hint.startswith("the data generation client failed on its own") and "did not answer" not in hint


DECODE = (b"[2026-03-01 10:00:00 TP0] Decode batch, #running-req: 8, #token: 2048, token usage: 0.02, accept len: "
          b"2.71, accept rate: 0.43, cuda graph: True, gen throughput (token/s): 512.40, #queue-req: 0\n")


@pytest.mark.parametrize("version, name", [("0.5.9", "accept_per_draft_slot"), ("0.5.10.post1", "accept_per_draft_slot"),
                                           ("0.5.11", "draft_accept_rate"), ("0.5.23", "draft_accept_rate"),
                                           (None, "draft_accept_rate")])
def test_sglangs_rate_is_named_by_its_version(version: str | None, name: str) -> None:
    """0.5.9 and 0.5.10 print the 0.5.23 layout (no trailing comma) with the old rate's meaning."""
    p = LogParser(engine="sglang", engine_version=version)
    p.feed(DECODE)
    rates = {k for k in p.metrics if k in ("accept_per_draft_slot", "draft_accept_rate")}
    assert rates == {name} and p.metrics["accept_rate"] == 0.43
    resumed = LogParser.from_dict(p.to_dict())
    resumed.feed(DECODE)
    assert name in resumed.metrics and resumed.engine_version == version


def test_an_unknown_engine_version_is_told_what_is_assumed() -> None:
    assert assumption("sglang", "0.5.9") is None and assumption("vllm", "0.32.0+cpu") is None
    assert assumption("sglang", "0.6.1") == ("sglang 0.6.1 is newer than orch knows (0.4.10 to 0.5.23): its lines "
                                             "are read as 0.5.23's")
    assert assumption("vllm", "0.5.4") == "vllm 0.5.4 is older than orch knows (0.6 to 0.33): its lines are read as 0.6's"
    assert assumption("generic", "1.0") is None and assumption("sglang", "unknown") is None


def read_rest(store: Store, w: Recorder, log: bytes, exit_code: int | None) -> None:
    """The end's read of the log (runflow.lastread) after the run was ended: the job is gone, `exit_code` its
    own, and the rest of `log` is what the host still has."""
    from types import SimpleNamespace

    from orchestrator.runflow.lastread import read_to_end

    class Executor:
        transport = None

        def poll(self, paths: Any, job: Any, offset: int, limit: int, **_: Any) -> JobState:
            return JobState(alive=False, exit_code=exit_code, size=len(log), offset=offset, data=log[offset:],
                            started_at=999_000.0)

    run = SimpleNamespace(refresh=lambda: store.get_run(w.run_id), executor=Executor(), paths=None,
                          store=store, run_id=w.run_id, event=lambda *a: None,
                          pb=SimpleNamespace(log_engine=lambda s: None, ready_pattern=lambda s: None), spec=None)
    read_to_end(run)  # type: ignore[arg-type]


def test_the_ends_read_records_the_servers_own_exit_code(tmp_path: Path) -> None:
    """A killed engine core fails the run at once; the API server exits 0 a moment later, and that is kept."""
    log = (LOGS / "vllm_0_32_cpu_engine_core_sigkill.log").read_bytes()
    store, w, _, _ = watched(tmp_path)
    head = log[:log.index(b"INFO:     Shutting down")]
    assert not push(w, head)
    transition(store, w.run_id, Status.FAILED, "fatal error in log")
    rest = log[len(head):]

    read_rest(store, w, log, exit_code=0)
    run = store.get_run(w.run_id)
    assert run.exit_code == 0 and run.status is Status.FAILED and run.log_offset == len(head) + len(rest)
    assert run.error is not None and run.error["kind"] == "killed"


def test_failed_requests_of_every_block_count(tmp_path: Path) -> None:
    """A job that runs several benchmarks: a later clean block does not hide an earlier one's failures."""
    clean = BENCH.replace(b"Successful requests:                     59", b"Successful requests:                     200") \
        .replace(b"Failed requests:                         141", b"Failed requests:                         0")
    store, w, _, _ = watched(tmp_path)
    assert push(w, BENCH + clean, exit_code=0)
    assert store.get_run(w.run_id).reason == "141 of 400 benchmark requests failed (max_failed_fraction 0)"


@pytest.mark.parametrize("version, warned", [("0.32.0+cpu", []), ("0.40.1", [
    "vllm 0.40.1 is newer than orch knows (0.6 to 0.33): its lines are read as 0.33's"])])
def test_a_version_the_log_tells_is_checked_once(tmp_path: Path, version: str, warned: list[str]) -> None:
    store, w, _, _ = watched(tmp_path)
    line = (f"(EngineCore pid=3411) INFO 12-06 04:30:15 [core.py:133] Initializing a V1 LLM engine (v{version}) with "
            f"config: model='models/tiny'\n").encode()
    push(w, line)
    push(w, line)
    assert [e["message"] for e in store.events(w.run_id) if e["kind"] == "warning"] == warned
    assert LogParser.from_dict(store.get_run(w.run_id).parser_state or {}).engine_version == version


def test_the_installed_version_a_playbook_found_is_the_logs(tmp_path: Path) -> None:
    """serve-eagle3 looks up the installed SGLang: the log is read for it, and one it does not know is told."""
    from types import SimpleNamespace

    from orchestrator.runflow.starting import note_engine_version

    store, w, _, _ = watched(tmp_path)
    events: list[str] = []
    run = SimpleNamespace(store=store, run_id=w.run_id, spec=None, event=lambda kind, message: events.append(message),
                          pb=SimpleNamespace(log_engine=lambda s: "sglang", ready_pattern=lambda s: None))
    note_engine_version(run, "0.5.9")  # type: ignore[arg-type]
    assert events == []
    state = store.get_run(w.run_id).parser_state
    p = LogParser.from_dict(state or {})
    p.feed(DECODE)
    assert "accept_per_draft_slot" in p.metrics and "draft_accept_rate" not in p.metrics
    note_engine_version(run, "0.7.0")  # type: ignore[arg-type]
    assert events == ["sglang 0.7.0 is newer than orch knows (0.4.10 to 0.5.23): its lines are read as 0.5.23's"]


class SGLangHost:
    """A host whose python has this SGLang installed, as a playbook's prepare asks it (playbook.Remote)."""

    def __init__(self, version: str) -> None:
        self.version = version
        self.asked: list[list[str]] = []

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None:
        pass

    def run_argv(self, argv: list[str], *, check: bool = True, timeout: float | None = None) -> Any:
        from orchestrator.host.transport import Result

        self.asked.append(argv)
        found = self.version if argv[-1] == "sglang" else "none"
        return Result("local", " ".join(argv), 0, f"{found}\n", "")


@pytest.mark.parametrize("playbook", ["serve-eagle3", "serve-bench"])
@pytest.mark.parametrize("debug", [False, True])
def test_the_sglang_playbooks_read_the_log_for_the_installed_version(tmp_path: Path, playbook: str,
                                                                    debug: bool) -> None:
    """0.5.9 prints the newer layout with the old rate's meaning: both SGLang servers look the version up
    (once), and the run's log is read for it."""
    from types import SimpleNamespace

    from orchestrator.host.launch import RunPaths
    from orchestrator.playbook import RunContext
    from orchestrator.runflow.starting import note_engine_version
    from playbooks.serve_bench import ServeBench
    from playbooks.serve_eagle3 import ServeEagle3

    pb = {"serve-eagle3": ServeEagle3(), "serve-bench": ServeBench()}[playbook]
    spec = pb.Spec.model_validate({"model": "/m/t", "draft_model": "/m/d", "debug": debug})
    host = SGLangHost("0.5.9")
    job = RunContext(1, spec, local_host(tmp_path), RunPaths(str(tmp_path / "r")), host, lambda run_id: None,  # type: ignore[arg-type]
                     lambda kind, message: None)
    prepared = pb.prepare(job)
    assert prepared.engine_version == "0.5.9" and len(host.asked) == 1
    store, w, _, _ = watched(tmp_path)
    run = SimpleNamespace(store=store, run_id=w.run_id, spec=spec, pb=pb, event=lambda kind, message: None)
    note_engine_version(run, prepared.engine_version)  # type: ignore[arg-type]
    p = LogParser.from_dict(store.get_run(w.run_id).parser_state or {})
    p.feed(DECODE)
    assert "accept_per_draft_slot" in p.metrics and "draft_accept_rate" not in p.metrics


def test_orch_stop_leaves_a_stopped_server_without_an_error(tmp_path: Path) -> None:
    """The end's read of a stopped vLLM server's log: its shutdown's EngineDeadError is no error of the run."""
    log = (LOGS / "vllm_0_32_cpu_clean_stop_engine_dead.log").read_bytes()
    store, w, _, _ = watched(tmp_path)
    head = log[:log.index(b"(APIServer pid=7310) INFO 12-06 05:03:30 [launcher.py:101]")]
    assert not push(w, head)
    transition(store, w.run_id, Status.CANCELLED, "stopped by user")

    read_rest(store, w, log, exit_code=None)
    run = store.get_run(w.run_id)
    assert run.error is None and run.phase == "running"
    assert not [e for e in store.events(w.run_id) if e["kind"] == "error"]


def test_a_model_vllm_cannot_find_is_a_missing_directory() -> None:
    p = LogParser()
    p.feed(b"(APIServer pid=1) Traceback (most recent call last):\n"
           b"(APIServer pid=1)   File \"/v/bin/vllm\", line 10, in <module>\n"
           b"(APIServer pid=1)     sys.exit(main())\n"
           b"(APIServer pid=1) ValueError: Invalid repository ID or local directory specified: 'models/tiny-gone'.\n"
           b"(APIServer pid=1) Please verify the following requirements:\n")
    p.finish(exit_code=1)
    assert p.error is not None and p.error.hint is not None and p.error.hint.startswith("no such model directory")


def test_a_gpu_hosts_kv_refusal_gets_gpu_advice() -> None:
    """vLLM's KV cache refusal mentions the CPU backend on any device: only the CPU's own lines make a CPU host."""
    lines = (LOGS / "vllm_0_32_cpu_kv_cache_too_small.log").read_text().splitlines(keepends=True)
    on_gpu = "".join(x.replace("device_config=cpu", "device_config=cuda") for x in lines
                     if "cpu_model_runner" not in x and "cpu_worker" not in x)
    p = LogParser()
    p.feed(on_gpu.encode())
    p.finish(exit_code=1)
    assert not p.cpu and p.error is not None and p.error.hint is not None
    assert "VLLM_CPU_KVCACHE_SPACE" not in p.error.hint and "--gpu-memory-utilization" in p.error.hint


def test_an_engine_core_that_died_of_its_own_error_was_not_killed() -> None:
    lines = (LOGS / "vllm_0_32_cpu_engine_core_sigkill.log").read_text().splitlines(keepends=True)
    own = ("(EngineCore pid=8180) ERROR 12-06 05:11:19 [core.py:710] EngineCore encountered a fatal error.\n"
           "(EngineCore pid=8180) ERROR 12-06 05:11:19 [core.py:710] Traceback (most recent call last):\n"
           "(EngineCore pid=8180) ERROR 12-06 05:11:19 [core.py:710]   File \"/v/vllm/v1/engine/core.py\", line 701, "
           "in run_engine_core\n"
           "(EngineCore pid=8180) ERROR 12-06 05:11:19 [core.py:710]     engine_core.run_busy_loop()\n"
           "(EngineCore pid=8180) ERROR 12-06 05:11:19 [core.py:710] ValueError: token id 152000 out of range\n")
    p = LogParser()
    p.feed("".join([*lines[:5], own, *lines[5:]]).encode())
    p.finish()
    assert p.error is not None and (p.error.kind, p.error.exception) == ("python_exception", "ValueError")
