"""One watcher per host: real `orch` processes, real agents, real sshd, real SQLite; faults mid-run."""

from __future__ import annotations

import os
import signal
import sqlite3
import sys
import time
from pathlib import Path

import pytest
from orchtest import FAST, Orch, job_cmd, release, wait_for_file

WATCHER = b"orchestrator.watch.hostwatch"  # a host's watcher: `python -m orchestrator.watch.hostwatch HOST`


def processes(home: Path, word: bytes) -> list[int]:
    """Pids of orch's processes started with this HOME whose command line has `word`."""
    marker = f"HOME={home}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if word in argv and marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def agents(workdir: Path) -> list[int]:
    """Pids of agents running from a host's workdir (not the jobs' wrappers nor a patcher: the archive's
    `wrap` and `patch` entries)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"wrap" not in argv and b"patch" not in argv and any(
                    a.startswith(str(workdir / "runs" / "hostjobs" / "hostjobs-").encode()) for a in argv):
                found.append(int(proc.name))
    return found


def detach(orch: Orch, host: str, *job: str, gpu: int = 0) -> int:
    res = orch("run", "command", "--host", host, "--detach", "--set", job_cmd(*job), "--set", f"gpus=[{gpu}]",
               *FAST, check=0)
    return int(res.stdout)


def test_runs_on_one_host_share_one_watcher_and_one_agent(orch: Orch, tmp_path: Path, private_home: Path) -> None:
    gate = tmp_path / "gate"  # every job waits half way until the test has looked
    ids = [detach(orch, "test1", "--steps", "150", "--sleep", "0.01", "--pause", f"75:{gate}", gpu=i)
           for i in range(4)]
    for run_id in ids:
        orch.wait_for(run_id, lambda d: d["progress"] is not None and d["progress"]["done"] == 75)
    assert all(orch.status(i)["status"] == "running" for i in ids)
    assert len(processes(private_home, WATCHER)) == 1
    deadline = time.time() + 30  # the agents of the commands that started the runs end with their channels
    while len(agents(tmp_path / "remote1")) > 1 and time.time() < deadline:
        time.sleep(0.2)
    assert len(agents(tmp_path / "remote1")) == 1
    release(gate)
    for run_id in ids:
        doc = orch.wait_for(run_id, lambda d: d["status"] == "succeeded", timeout=120)
        assert doc["progress"]["done"] == 150
        assert [e["message"] for e in doc["events"] if e["kind"] == "phase"].count("running") == 1
    deadline = time.time() + 30  # gone once its host has no active run
    while processes(private_home, WATCHER):
        assert time.time() < deadline, "the host's watcher outlived its last run"
        time.sleep(0.2)


COUNT = """
import pathlib, sys, time
n, marker, go = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
print("Loading safetensors checkpoint shards: 100% Completed | 2/2 [00:02<00:00]", flush=True)
for i in range(n):
    print(f"orch-metric n={i}", flush=True)
    if i == n // 2:  # halfway: held until the test has killed the watcher, however slow the machine
        pathlib.Path(marker).touch()
        while not go.exists():
            time.sleep(0.01)
    time.sleep(0.002)
"""


def test_a_killed_host_watcher_is_restarted_by_status_and_no_event_is_lost_or_doubled(
        orch: Orch, tmp_path: Path, private_home: Path) -> None:
    """Two runs stream a metric line every 2 ms, so every turn of the host's watcher records pushes of both
    in one transaction; killed mid-stream, the next watcher reads on from the record: each run has every
    sample once, in order, and the events recorded before the kill, unchanged and not repeated."""
    script = tmp_path / "count.py"
    script.write_text(COUNT)
    n = 1500
    markers, go = [tmp_path / f"half{i}" for i in (0, 1)], tmp_path / "go"
    ids = [int(orch("run", "command", "--host", "test1", "--detach", "--set",
                    f"cmd={sys.executable} {script} {n} {marker} {go}", "--set", f"gpus=[{i}]", *FAST,
                    check=0).stdout) for i, marker in enumerate(markers)]
    wait_for_file(markers[0])
    orch.wait_for(ids[0], lambda d: "n" in d["metrics"])  # the host's watcher is up and recording
    [watcher] = processes(private_home, WATCHER)
    os.kill(watcher, signal.SIGKILL)
    release(go)
    before = {run_id: orch.status(run_id)["events"] for run_id in ids}
    time.sleep(1.0)
    orch("status", check=0)  # finds the runs unwatched and starts their host's watcher again
    with sqlite3.connect(orch.db) as db:  # every sample in order: no command prints a metric's whole series
        for run_id in ids:
            doc = orch.wait_for(run_id, lambda d: d["status"] == "succeeded", timeout=90)
            assert doc["events"][: len(before[run_id])] == before[run_id]
            phases = [e["message"] for e in doc["events"] if e["kind"] == "phase"]
            assert len(phases) == len(set(phases)), phases
            values = [int(v) for (v,) in db.execute(
                "SELECT value FROM metrics WHERE run_id = ? AND name = 'n' ORDER BY id", (run_id,))]
            assert values == list(range(n))


def test_an_agent_killed_on_the_host_is_started_again(orch: Orch, tmp_path: Path) -> None:
    marker = tmp_path / "half"
    run_id = detach(orch, "test2", "--steps", "40", "--sleep", "0.1", "--marker", str(marker))
    wait_for_file(marker)
    [agent] = agents(tmp_path / "remote2")
    os.kill(agent, signal.SIGKILL)
    doc = orch.wait_for(run_id, lambda d: d["status"] == "succeeded", timeout=90)
    assert doc["progress"]["done"] == 40
    kinds = [e["kind"] for e in doc["events"]]
    assert "unreachable" in kinds and "reconnected" in kinds
    assert agent not in agents(tmp_path / "remote2")


def test_a_fatal_line_while_the_ranks_hang_fails_the_run_and_stops_its_group(orch: Orch, tmp_path: Path) -> None:
    script = tmp_path / "hang.sh"
    script.write_text("echo 'Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01]'\n"
                      "sleep 300 &\n"
                      "echo '[rank3]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 3] Watchdog caught collective "
                      "operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE) ran for 600000 milliseconds'\n"
                      "wait\n")
    res = orch("run", "command", "--host", "test1", "--detach", "--set", f"cmd=bash {script}", *FAST, check=0)
    run_id = int(res.stdout)
    doc = orch.wait_for(run_id, lambda d: d["status"] == "failed", timeout=60)
    assert "fatal error in log" in doc["reason"]
    doc = orch.wait_for(run_id, lambda d: any(e["kind"] == "stopped" for e in d["events"]), timeout=30)
    assert "stopped" in next(e["message"] for e in doc["events"] if e["kind"] == "stopped")


def test_a_host_whose_python_cannot_run_the_agent_is_one_line_before_anything(tmp_path: Path) -> None:
    orch = Orch(tmp_path / "ws", '[hosts.local]\npython = "/nonexistent/python3"\n')
    res = orch("hosts", "--check", "--json")
    assert "its python cannot run orch's agent: /nonexistent/python3" in res.stdout
    res = orch("run", "command", "--set", "cmd=touch should-not-exist", check=2)
    [line] = res.stderr.strip().splitlines()
    assert "its python cannot run orch's agent" in line and "Traceback" not in res.stderr
    doc = orch.status(1)
    assert doc["status"] == "failed" and doc["phase"] is None
    assert not any(e["kind"] == "gpu" for e in doc["events"])  # nothing was touched on the host


def test_a_job_that_did_not_survive_a_reboot_ends_lost_saying_so(orch: Orch, tmp_path: Path) -> None:
    """A reboot as the host tells it afterwards: the job's processes are gone, no exit code was written,
    and the host booted after the job started (the wrapper's own start time is older than /proc/stat's
    btime)."""
    run_id = detach(orch, "test1", "--steps", "400", "--sleep", "0.05")
    doc = orch.wait_for(run_id, lambda d: d["progress"] is not None)
    control = Path(doc["remote_dir"]) / ".orch"
    wrapper = int((control / "pid").read_text().split()[0])
    (control / "started_at").write_text("1000000000.0\n")  # 2001: before this host's boot
    os.killpg(wrapper, signal.SIGKILL)
    doc = orch.wait_for(run_id, lambda d: d["status"] == "lost", timeout=60)
    assert "the host rebooted since the job started" in doc["reason"]


def test_the_background_watchers_import_nothing_from_the_folder_orch_starts_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host's watcher (`python -m orchestrator.watch.hostwatch`) and a run's (`python -m orchestrator`)
    start in the folder orch was started from: a `hashlib.py` planted there is never imported."""
    from orchestrator.config.workspace import Workspace
    from orchestrator.runflow import watching

    marker = tmp_path / "pwned"
    here = tmp_path / "here"
    here.mkdir()
    (here / "hashlib.py").write_text(f"import pathlib, sys\npathlib.Path({str(marker)!r}).write_text(str(sys.argv))\n")
    ws = Workspace(root=tmp_path / "ws", hosts_file=tmp_path / "ws" / "hosts.toml")
    ws.root.mkdir()
    ws.hosts_file.write_text("")
    monkeypatch.chdir(here)
    watching.spawn_host(ws, "nohost")
    watching.spawn(ws, 7)
    logs = (watching.host_lock_path(ws, "nohost").with_suffix(".log"), ws.run_dir(7) / "watcher.log")
    deadline = time.monotonic() + 60
    while not all(log.exists() and "orch:" in log.read_text() for log in logs):  # each said why it ended
        assert time.monotonic() < deadline, [log.read_text() for log in logs if log.exists()]
        time.sleep(0.05)
    assert not marker.exists(), marker.read_text()
