"""Who holds a lease, alive or not: a table over heartbeats and watchers, with the clock injected."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostdirs import HostDirs

from orchestrator.host.hostjobs import leases
from orchestrator.store import Store
from orchestrator.store.controller import STALE_FACTOR, Controller, process_start
from orchestrator.store.lease import BEFORE_RELEASE, Busy, Lease, held, holder_alive
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import RunRecord, Status

NOW = 1_000_000.0
POLL_MAX = 10.0  # a heartbeat older than STALE_FACTOR * POLL_MAX s is stale
ELSEWHERE = Controller("gpu-box-2", 4242, "777")  # a controller on another machine: only heartbeats say
DEAD_HERE = Controller(socket.gethostname(), 2**22 + 1, "1")  # above pid_max by default: no such process
ME = Controller.me()


def lease(controller: Controller, heartbeat: float) -> Lease:
    return Lease(1, "h", None, 7, controller, heartbeat, POLL_MAX)


def run(watcher: Controller | None = None, heartbeat: float | None = None) -> RunRecord:
    return RunRecord(7, "command", "h", Status.RUNNING, watcher=str(watcher) if watcher else None, heartbeat=heartbeat)


STALE = NOW - STALE_FACTOR * POLL_MAX - 1
FRESH = NOW - 1


@pytest.mark.parametrize("holder, beat, watched_by, run_beat, alive", [
    (ELSEWHERE, FRESH, None, None, True),  # a recent heartbeat
    (ELSEWHERE, STALE, None, None, False),  # silent for too long
    (ELSEWHERE, STALE, ELSEWHERE, FRESH, True),  # its own watch stamps the run
    (ELSEWHERE, STALE, Controller("gpu-box-3", 9, "5"), FRESH, True),  # someone took over the watch
    (ELSEWHERE, STALE, Controller("gpu-box-3", 9, "5"), STALE, False),  # ... and went silent too
    (ELSEWHERE, STALE, ME, FRESH, False),  # this process's own probe of the orphan does not count
    (DEAD_HERE, FRESH, None, None, False),  # on this machine the kernel is asked, not the heartbeat
    (ME, STALE, None, None, True),
    (Controller(ME.hostname, ME.pid, "1"), FRESH, None, None, False),  # this pid, but not this process
])
def test_holder_alive(holder: Controller, beat: float, watched_by: Controller | None, run_beat: float | None,
                      alive: bool) -> None:
    assert holder_alive(lease(holder, beat), run(watched_by, run_beat), now=NOW) is alive


@pytest.mark.parametrize("text, parsed", [
    ("box:12:345", Controller("box", 12, "345")),
    ("box:12:", Controller("box", 12, None)),
    ("box:12", Controller("box", 12, None)),  # a watcher written before start times were recorded
    ("", None), ("box", None), ("box:x:1", None), ("a:b:c:d", None),
])
def test_one_encoding(text: str, parsed: Controller | None) -> None:
    assert Controller.parse(text) == parsed
    if parsed is not None:
        assert Controller.parse(str(parsed)) == parsed


def test_me_is_mine() -> None:
    assert ME.is_mine and ME.start == process_start(os.getpid())
    assert not Controller(ME.hostname, ME.pid, "0").is_mine


# --- the host, not a heartbeat, frees a lease --------------------------------------------------------


@pytest.fixture
def job() -> Iterator[subprocess.Popen]:
    """A job's wrapper: the leader of a process group of its own."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def ended_run_of_a_dead_finisher(store: Store, at: HostDirs, job: subprocess.Popen) -> int:
    """A run that ended (cancelled) while whoever was ending it died before its end steps, and whose job
    still runs on its host: the host holds its lease, which names a controller that is gone."""
    [run_id] = at.acquire(["h"], lambda: [store.create_run("command", "h", {})], [0])
    store.conn.execute("UPDATE leases SET pid = ?, pid_start = ?, hostname = ? WHERE run_id = ?",
                       (DEAD_HERE.pid, DEAD_HERE.start, DEAD_HERE.hostname, run_id))
    for status in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING, Status.CANCELLED):
        transition(store, run_id, status)
    store.update_run(run_id, pid=job.pid, pid_start=process_start(job.pid))
    control = Path(at.run_dir("h", run_id)) / ".orch"
    (control / "pid").write_text(f"{job.pid} {process_start(job.pid)}\n")
    return run_id


def test_an_ended_runs_lease_goes_only_once_the_host_shows_its_job_over(store: Store, tmp_path: Path,
                                                                       job: subprocess.Popen) -> None:
    at = HostDirs(tmp_path, store)
    old = ended_run_of_a_dead_finisher(store, at, job)
    asked: list[int] = []

    def host_says_it_runs(run: RunRecord) -> None:
        asked.append(run.id)

    make = lambda: [store.create_run("command", "h", {})]
    with pytest.raises(Busy, match=f"run {old}"):
        at.acquire(["h"], make, [0], host_says_it_runs)
    assert asked == [old] and [lease.run_id for lease in held(store)] == [old]
    assert len(store.list_runs()) == 1  # refused: no run was made
    assert at.acquire(["h"], make, [1], host_says_it_runs)

    def host_says_it_ended(run: RunRecord) -> None:
        at.release(run.id, "h")  # as the run flow's probe does once the host shows the job over

    [new] = at.acquire(["h"], make, [0], host_says_it_ended)
    assert old not in [lease.run_id for lease in held(store)] and new in [lease.run_id for lease in held(store)]


def test_a_lease_whose_release_was_lost_goes_to_the_probe_though_its_holder_lives(
        store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run ended and its end steps before release were done by this very process, but its host never
    heard the release (it was unreachable then): the host still names it, and the probe releases it."""
    monkeypatch.setattr("orchestrator.store.lease.ENDING_WAIT_S", 1.0)  # end steps that never end: a take's wait
    at = HostDirs(tmp_path, store)
    make = lambda: [store.create_run("command", "h", {})]
    [old] = at.acquire(["h"], make)
    for status in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING, Status.SUCCEEDED):
        transition(store, old, status)
    at.end_job(old, "h")
    with pytest.raises(Busy, match=f"run {old} "):  # its end steps run: waited for, then named busy
        at.acquire(["h"], make)
    for step in BEFORE_RELEASE:
        store.add_event(old, "finished", step)
    [new] = at.acquire(["h"], make, probe=lambda run: at.release(run.id, "h"))
    assert [lease.run_id for lease in held(store)] == [new]


def test_the_host_holds_an_ended_jobs_lease_while_its_end_steps_run_and_no_longer(tmp_path: Path) -> None:
    """Whichever workspace asks: a job that ended minutes ago still holds (its log is read to its end, its
    patches reverted, then it is released), one that ended longer ago than ENDING_S does not."""
    run_dir = tmp_path / "runs" / "1"
    (run_dir / ".orch").mkdir(parents=True)
    (run_dir / ".orch" / "token").write_text("elsewhere:/db:1:0\n")
    exit_code = run_dir / ".orch" / "exit_code"
    exit_code.write_text("0\n")
    doc = {"token": "elsewhere:/db:1:0", "run_dir": str(run_dir), "taken_at": time.time() - 100, "over_at": None}
    assert leases.liveness(doc, time.time())[0] is True
    os.utime(exit_code, (time.time() - leases.ENDING_S - 1,) * 2)
    assert leases.liveness(doc, time.time())[0] is False


def test_a_stopped_job_holds_its_host_from_when_the_host_first_saw_it_over(tmp_path: Path, store: Store) -> None:
    """A stopped job has no exit code to date its end: the first take that finds it over records that
    moment in its lease file, and it holds for ENDING_S from then (a release comes sooner)."""
    at = HostDirs(tmp_path, store)
    make = lambda: [store.create_run("command", "h", {})]
    [old] = at.acquire(["h"], make)
    job = subprocess.Popen(["true"], start_new_session=True)
    job.wait()  # its wrapper, gone without an exit code
    (Path(at.run_dir("h", old)) / ".orch" / "pid").write_text(f"{job.pid} 1\n")
    lease_file = tmp_path / "h" / "leases" / "host"
    seen = []
    for _ in range(2):
        with pytest.raises(Busy, match=f"run {old} "):
            at.acquire(["h"], make, probe=lambda run: None)
        seen.append(json.loads(lease_file.read_text())["over_at"])
    first_seen = seen[0]
    assert time.time() - 60 < first_seen <= time.time() and seen == [first_seen] * 2  # recorded once
    doc = json.loads(lease_file.read_text())
    lease_file.write_text(json.dumps(dict(doc, over_at=time.time() + 86400)))  # a future moment is not believed
    assert leases.liveness(leases.parse_lease(lease_file.read_text(), [str(tmp_path / "h" / "runs")]),
                           time.time())[0] is False
    lease_file.write_text(json.dumps(dict(doc, over_at=first_seen - leases.ENDING_S)))
    assert at.acquire(["h"], make, probe=lambda run: None) == [old + 1]
