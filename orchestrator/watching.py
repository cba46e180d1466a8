"""Every active run is always watched: who watches a run, and a watcher for a run nobody watches.

Whoever polls a run holds its lock, `runs/<id>/watch.lock` (an flock, so it is gone with its process):
`orch run` and `orch watch` in a terminal, a sweep's controller, or a background watcher (`orch watch ID
--background`) that orch starts for a run nobody watches — right after `orch run --detach`, and from any
`orch status` that finds an active run unwatched (its watcher was killed, the machine rebooted). Anyone
else who wants to follow the run reads its record instead of polling the host a second time.

A process per run rather than one service: nothing to install or supervise, it lives as long as its run
and takes no other run down with it, and the lock makes a duplicate harmless (it exits at once).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

from .controller import STALE_FACTOR
from .record import ACTIVE, Run
from .store import Store
from .workspace import Workspace

FOLLOW_S = 0.5  # how often a follower reads the record


class WatchLock:
    """The run's watch lock, taken without waiting; `held` says whether this process has it."""

    def __init__(self, ws: Workspace, run_id: int):
        self.path = ws.run_dir(run_id) / "watch.lock"
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        if self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
            except BlockingIOError:
                os.close(fd)
        return self.held

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def watched_here(ws: Workspace, run_id: int) -> bool:
    """Does a process on this machine hold the run's watch lock?"""
    with WatchLock(ws, run_id) as lock:
        return not lock.held


def watched_elsewhere(run: Run, poll_max: float) -> bool:
    """Is the run polled from another machine (a shared database) that wrote a heartbeat lately?"""
    who = run.watched_by
    return who is not None and not who.is_local and who.alive(run.heartbeat, STALE_FACTOR * poll_max)


def spawn(ws: Workspace, run_id: int) -> None:
    """Start a background watcher for the run: its own session, so it outlives this command."""
    log = ws.run_dir(run_id) / "watcher.log"
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "ORCH_HOME": str(ws.root),
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", "orchestrator", "--hosts", str(ws.hosts_file), "watch", str(run_id), "--background"]
    with open(log, "ab") as out:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)


def ensure_watched(ws: Workspace, store: Store, runs: list[Run] | None = None, poll_max: float = 600.0) -> list[int]:
    """Start a background watcher for each active run that nobody watches; the ids it started one for."""
    if runs is None:
        runs = store.list_runs(limit=100_000, statuses=[s.value for s in ACTIVE])
    started = []
    for run in runs:
        if run.status.terminal or watched_elsewhere(run, poll_max) or watched_here(ws, run.id):
            continue
        spawn(ws, run.id)
        started.append(run.id)
    return started


def follow_record(ws: Workspace, store: Store, run_id: int, on_update: Callable[[Run], None] | None = None,
                  until_ready: bool = False, sleep: Callable[[float], None] = time.sleep) -> Run:
    """Follow a run another process on this machine watches, by its record, until it ends (or, with
    until_ready, is ready) or nobody watches it any more."""
    while True:
        run = store.get_run(run_id)
        if on_update is not None:
            on_update(run)
        if run.status.terminal or (until_ready and run.phase in ("ready", "running")):
            return run
        if not watched_here(ws, run_id):
            return run
        sleep(FOLLOW_S)
