"""Who holds a lease, alive or not: a table over heartbeats and watchers, with the clock injected."""

from __future__ import annotations

import os
import socket

import pytest

from orchestrator.controller import STALE_FACTOR, Controller, process_start
from orchestrator.lease import Lease, holder_alive
from orchestrator.record import Run, Status

NOW = 1_000_000.0
POLL_MAX = 10.0  # a heartbeat older than STALE_FACTOR * POLL_MAX s is stale
ELSEWHERE = Controller("gpu-box-2", 4242, "777")  # a controller on another machine: only heartbeats say
DEAD_HERE = Controller(socket.gethostname(), 2**22 + 1, "1")  # above pid_max by default: no such process
ME = Controller.me()


def lease(controller: Controller, heartbeat: float) -> Lease:
    return Lease(1, "h", None, 7, controller, heartbeat, POLL_MAX)


def run(watcher: Controller | None = None, heartbeat: float | None = None) -> Run:
    return Run(7, "command", "h", Status.RUNNING, watcher=str(watcher) if watcher else None, heartbeat=heartbeat)


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
