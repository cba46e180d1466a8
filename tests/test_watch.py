"""The wait: the host watcher's backoff that resets on progress and respects predictions; stalls; history."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from orchtest import FAST, Orch, job_cmd

from orchestrator import runflow
from orchestrator.config.hosts import local_host
from orchestrator.config.workspace import Workspace
from orchestrator.host import launch
from orchestrator.host.agent import AgentLink
from orchestrator.host.launch import HostExecutor
from orchestrator.host.polling import PollWait
from orchestrator.host.remote import LocalTransport
from orchestrator.runflow import registry
from orchestrator.runflow.recorder import Recorder, WatchOptions
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import RunRecord, Status
from orchestrator.watch import follow
from playbooks.command import CommandSpec

EMULATOR = Path(__file__).parent / "fakes" / "sglang_emulator.py"


def test_backoff_doubles_to_the_cap_and_resets():
    wait = PollWait(30, 600, clock=lambda: 0.0)
    waits = [wait(None) for _ in range(7)]
    assert waits == [30, 60, 120, 240, 480, 600, 600]
    wait.reset()
    assert wait(None) == 30


def test_backoff_never_sleeps_past_the_predicted_finish_by_more_than_poll_min():
    now = [1000.0]
    wait = PollWait(30, 600, clock=lambda: now[0])
    for _ in range(5):
        wait(None)  # the streak is at 480 s now
    wait.finish_at = 1100.0
    assert wait(None) == 130  # 100 s to the ETA + poll_min
    now[0] = 1200.0
    assert wait(None) == 30  # past the ETA: poll_min
    wait.immediate = True
    assert wait(None) == 0


def pokes_for_quiet_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, poll_min: float, poll_max: float) -> int:
    """Looks the host's watcher asks of the agent (pokes: a round trip each) over a silent 3 s job."""
    pokes: list[list[str]] = []
    tell = AgentLink.tell

    def counting(link: AgentLink, op: str, **args: object) -> None:
        if op == "poke":
            pokes.append(list(args["keys"]))  # type: ignore[arg-type]
        tell(link, op, **args)

    monkeypatch.setattr(AgentLink, "tell", counting)
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    host = local_host(tmp_path).model_copy(update={"unreachable_give_up_s": 3600.0})  # no inventory has it: watched in process
    spec = CommandSpec(cmd="sleep 3", cleanup=False, poll_min=poll_min, poll_max=poll_max)
    run = follow.watch(runflow.start(ws, store, registry.playbook("command"), spec, host))
    assert run.status == "succeeded"
    return len(pokes)


def test_backoff_makes_fewer_round_trips_than_a_fixed_poll(tmp_path, monkeypatch):
    fixed = pokes_for_quiet_job(tmp_path / "fixed", monkeypatch, 0.05, 0.05)
    backoff = pokes_for_quiet_job(tmp_path / "backoff", monkeypatch, 0.05, 1.0)
    assert backoff <= 10  # 0.05, 0.1, 0.2, 0.4, 0.8, then 1 s, until the job's exit is pushed
    assert fixed > backoff  # one per 0.05 s; how many fewer is bench/detection_lag.py's


def until_done(rec: Recorder, timeout: float = 30) -> RunRecord:
    """One-shot looks (as `orch status --refresh` makes) until the run ended."""
    deadline = time.monotonic() + timeout
    while not rec.look():
        assert time.monotonic() < deadline, rec.record
        time.sleep(0.05)
    return rec.record


@pytest.mark.parametrize("action", ["warn", "kill", "dump"])
def test_a_stalled_bar_is_flagged_and_acted_on(tmp_path, action):
    orch = Orch(tmp_path / "ws")
    orch.env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # py-spy beside python
    res = orch("run", "command", "--detach", "--set", job_cmd("--steps", "40", "--sleep", "0.1", "--stall-at", "10"),
               "--set", "stall_factor=5", "--set", f"on_stall={action}", *FAST, check=0)
    run_id = int(res.stdout)
    if action == "warn":
        proc = orch.spawn("watch", str(run_id))
        # a loaded machine may flag a slow step before the bar stops for good: the stall that stays is at 10
        doc = orch.wait_for(run_id, lambda d: d["stalled"] and (d["progress"] or {}).get("done") == 10, timeout=60)
        assert doc["status"] == "running"
        assert any(e["kind"] == "stalled" for e in doc["events"])
        assert "stalled" in orch("status", check=0).stdout
        orch("cancel", str(run_id), "--grace", "1", check=0)
        proc.wait(timeout=30)
    elif action == "kill":
        res = orch("watch", str(run_id), timeout=60)
        doc = orch.status(run_id)
        assert res.returncode == 1 and doc["status"] == "failed" and "stalled" in doc["reason"]
        assert not Path(f"/proc/{doc['pid']}").exists() or "Z" in Path(f"/proc/{doc['pid']}/stat").read_text()
    else:
        proc = orch.spawn("watch", str(run_id))
        deadline = time.time() + 60
        while time.time() < deadline:
            doc = orch.status(run_id)
            dumps = [e for e in doc["events"] if e["kind"] == "stall-dump"]
            if dumps:
                break
            time.sleep(0.2)
        orch("cancel", str(run_id), "--grace", "1", check=0)
        proc.wait(timeout=30)
        assert dumps, doc["events"]
        assert "progress_job.py" in dumps[0]["data"]["text"]  # py-spy's stack of the stuck job names its script


def test_load_time_predicted_from_history(tmp_path, ssh_fleet):
    orch = Orch(tmp_path / "ws", ssh_fleet.hosts_toml(test1={"workdir": str(tmp_path / "r")}))
    serve = job_cmd().replace(str(Path(__file__).parent / "jobs" / "progress_job.py"), str(EMULATOR))
    slow = [serve + " --shards 10 --shard-time 0.15 --capture-time 0.01", "--set", "engine=sglang"]
    assert orch("run", "command", "--host", "test1", "--set", *slow, *FAST).returncode == 0
    first = orch.status(1)
    ready_at = next(e["ts"] for e in first["events"]
                    if e["kind"] == "phase" and e["message"] not in ("starting", "loading"))
    took = ready_at - first["started_at"]
    assert first["predicted_ready_at"] is None
    assert orch("run", "command", "--host", "test1", "--set", *slow, *FAST).returncode == 0
    second = orch.status(2)
    predicted = second["predicted_ready_at"] - second["started_at"]
    assert predicted == pytest.approx(took, rel=0.01)


# Each leaves a process behind in the job's group, as the other ranks of a TP job do when one dies.
FATAL_LINES = {
    "nccl on one rank": (
        ("printf '%s\\n' '[rank3]: Traceback (most recent call last):' "
         "'[rank3]:   File \"/opt/train.py\", line 80, in step' '[rank3]:     dist.all_reduce(t)' "
         "'[rank3]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, "
         "unhandled system error'"),
        "nccl", "torch.distributed.DistBackendError"),
    "uncaught top-level traceback": (
        f"{sys.executable} -c 'import json; json.loads(\"\")'",
        "python_exception", "json.decoder.JSONDecodeError"),
    "vllm engine core died": (
        ("echo '(APIServer pid=7) ERROR 01-15 03:04:09 [core_client.py:564] Engine core proc EngineCore_0 died "
         "unexpectedly, shutting down client.'"),
        "other", None),
}


@pytest.mark.parametrize("name", sorted(FATAL_LINES))
def test_a_fatal_line_fails_the_run_and_stops_its_process_group(tmp_path, name):
    line, kind, exception = FATAL_LINES[name]
    orch = Orch(tmp_path / "ws")
    res = orch("run", "command", "--set", f"cmd=sleep 300 & {line}; wait", *FAST, timeout=120)
    assert res.returncode == 1
    doc = orch.status(1)
    assert doc["status"] == "failed" and doc["phase"] == "failed" and "fatal error in log" in doc["reason"]
    assert (doc["error"]["kind"], doc["error"]["exception"]) == (kind, exception) and doc["exit_code"] is None
    alive = os.popen(f"ps -eo pgid=,stat= | awk '$1 == {doc['pid']} && $2 !~ /^Z/'").read()
    assert alive == ""


def test_metric_samples_carry_the_lines_own_time(tmp_path):
    store = Store(tmp_path / "orch.db")
    run_id = store.create_run("command", "local", {})
    for s in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, s)
    transport = LocalTransport(local_host(tmp_path))
    paths = launch.RunPaths.for_run(str(tmp_path), run_id)
    past = time.time() - 100
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(past))
    later = time.strftime("%m-%d %H:%M:%S", time.localtime(time.time() + 7200))  # a host in another zone
    script = (
        f"echo 'INFO {stamp} [loggers.py:127] Engine 000: Avg prompt throughput: 5.0 tokens/s, "
        "Avg generation throughput: 42.5 tokens/s, Running: 1 reqs'; "
        f"echo 'INFO {later} [loggers.py:127] Engine 000: Avg prompt throughput: 5.0 tokens/s, "
        "Avg generation throughput: 43.5 tokens/s, Running: 1 reqs'; "
        "echo 'orch-metric loss=0.25 acc=0.5'"
    )
    job = HostExecutor(transport).launch(paths, launch.job_script(script, {}), f"t-{run_id}")
    store.update_run(run_id, remote_dir=paths.root)
    transition(store, run_id, Status.RUNNING, **job.columns())
    started = store.get_run(run_id).started_at
    store.update_run(run_id, started_at=past - 10)  # the job began before its first line
    run = until_done(Recorder(store, run_id, HostExecutor(transport), WatchOptions(poll_min=0.05, poll_max=0.2)))
    assert run.status == "succeeded"
    series = store.metric_series(run_id, "gen_throughput")
    assert [v for _, v, _ in series] == [42.5, 43.5]
    assert series[0][0] == pytest.approx(int(past), abs=1)  # the line's own second, not the poll's
    assert series[1][0] >= started  # a time the run cannot have printed: the poll time stands in
    assert [v for _, v, _ in store.metric_series(run_id, "loss")] == [0.25]
    assert store.latest_metrics(run_id) == {"acc": 0.5, "gen_throughput": 43.5, "loss": 0.25}
