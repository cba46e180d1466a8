"""Who holds a lease, alive or not: a table over heartbeats and watchers, with the clock injected."""

from __future__ import annotations

import os
import socket

import pytest

from orchestrator.store import Store
from orchestrator.store.controller import STALE_FACTOR, Controller, process_start
from orchestrator.store.lease import Busy, Lease, acquire, held, holder_alive, release
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


def ended_run_of_a_dead_finisher(store: Store) -> int:
    """A run that ended (cancelled) while whoever was ending it died before its end steps: its lease
    stays in the table, naming a controller that is gone."""
    run_id = acquire(store, "h", [0], lambda: store.create_run("command", "h", {}), POLL_MAX)
    store.conn.execute("UPDATE leases SET pid = ?, pid_start = ?, hostname = ? WHERE run_id = ?",
                       (DEAD_HERE.pid, DEAD_HERE.start, DEAD_HERE.hostname, run_id))
    for status in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING, Status.CANCELLED):
        transition(store, run_id, status)
    store.update_run(run_id, pid=4242, pid_start="1")
    return run_id


def test_an_ended_runs_lease_goes_only_once_the_host_shows_its_job_over(store: Store) -> None:
    old = ended_run_of_a_dead_finisher(store)
    asked: list[int] = []

    def host_says_it_runs(run: RunRecord) -> None:
        asked.append(run.id)

    with pytest.raises(Busy, match=f"run {old}"):
        acquire(store, "h", [0], lambda: store.create_run("command", "h", {}), POLL_MAX, host_says_it_runs)
    assert asked == [old] and [lease.run_id for lease in held(store)] == [old]
    assert len(store.list_runs()) == 1  # refused: no run was made
    assert acquire(store, "h", [1], lambda: store.create_run("command", "h", {}), POLL_MAX, host_says_it_runs)

    def host_says_it_ended(run: RunRecord) -> None:
        release(store, run.id)  # as the run flow's probe does once the host shows the job over

    new = acquire(store, "h", [0], lambda: store.create_run("command", "h", {}), POLL_MAX, host_says_it_ended)
    assert old not in [lease.run_id for lease in held(store)] and new in [lease.run_id for lease in held(store)]


def test_without_a_probe_an_ended_runs_lease_goes_on_the_records_word(store: Store) -> None:
    old = ended_run_of_a_dead_finisher(store)
    new = acquire(store, "h", [0], lambda: store.create_run("command", "h", {}), POLL_MAX)
    assert [lease.run_id for lease in held(store)] == [new] and new != old
