"""Every active run is always watched: who watches a run, and a watcher for a host nobody watches.

A host whose agent streams (an SSH host, this machine, a Slurm cluster's login node) has one watcher per
workspace, `python -m orchestrator.runflow.hostwatch NAME` (hostwatch.py; `orch watch-host NAME` runs the
same), found by its lock `runs/watchers/<host>.lock`; it follows every active run there, holding each run's
lock, `runs/<id>/watch.lock`, while it does. A run whose host no inventory knows (one made in process) is
polled by a watcher of its own that holds the run's lock: `orch run` or `orch watch` in a terminal, a
sweep's controller, or `orch watch ID --background`. Either is started for a run nobody watches — right
after `orch run`, and from any `orch status` that finds an active run unwatched (its watcher was killed,
the machine rebooted). Everyone else follows the run by its record instead of asking the host again.

The locks are flocks, gone with their process, so a duplicate watcher is harmless: it exits at once.
Nothing to install or supervise: a host's watcher lives as long as the host has active runs.
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

from ..config.hosts import Host, Inventory
from ..config.workspace import Workspace
from ..errors import OrchError
from ..host.executor import executor_class
from ..store import Store
from ..store.controller import STALE_FACTOR
from ..store.record import ACTIVE, Run

FOLLOW_S = 0.5  # how often a follower reads the record


class FileLock:
    """An flock taken without waiting; `held` says whether this process has it."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    shared = False  # a lock many may hold at once (followers), that excludes one taken exclusively

    def acquire(self) -> bool:
        if self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
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


class WatchLock(FileLock):
    """The run's watch lock: whoever follows the run on its host holds it."""

    def __init__(self, ws: Workspace, run_id: int):
        super().__init__(ws.run_dir(run_id) / "watch.lock")


class FollowLock(FileLock):
    """Held (shared) by whoever follows a run's record to show its end — `orch run`, `orch watch`, a sweep's
    lane: while one does, it runs the end steps itself, so its summary comes after them."""

    shared = True

    def __init__(self, ws: Workspace, run_id: int):
        super().__init__(ws.run_dir(run_id) / "follow.lock")


def followed(ws: Workspace, run_id: int) -> bool:
    """Does anyone on this machine follow the run's record (hold its follow lock)?"""
    lock = FileLock(ws.run_dir(run_id) / "follow.lock")
    with lock:
        return not lock.held


def host_lock_path(ws: Workspace, host: str) -> Path:
    folder = ws.runs_dir / "watchers"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{host}.lock"


def host_watched(ws: Workspace, host: str) -> bool:
    """Does a process on this machine watch the host (hold its lock)?"""
    with FileLock(host_lock_path(ws, host)) as lock:
        return not lock.held


def watched_here(ws: Workspace, run_id: int) -> bool:
    """Does a process on this machine hold the run's watch lock?"""
    with WatchLock(ws, run_id) as lock:
        return not lock.held


def watched_elsewhere(run: Run, poll_max: float) -> bool:
    """Is the run polled from another machine (a shared database) that wrote a heartbeat lately?"""
    who = run.watched_by
    return who is not None and not who.is_local and who.alive(run.heartbeat, STALE_FACTOR * poll_max)


def _spawn(ws: Workspace, log: Path, args: list[str]) -> None:
    """Start a background orch command in its own session, so it outlives this one."""
    _start(ws, log, ["-m", "orchestrator", "--hosts", str(ws.hosts_file), *args, "--background"])


def _start(ws: Workspace, log: Path, args: list[str]) -> None:
    """Start `python ARGS` in the workspace, in its own session, its output appended to `log`."""
    # the folder that holds the orchestrator package, not the package's own folder
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "ORCH_HOME": str(ws.root),
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    # -P: the folder orch was started from is not put on sys.path (`-m` would put it first), so nothing
    # planted there (a `hashlib.py`) is imported; PYTHONPATH above still finds orch
    argv = [sys.executable, "-P", *args]
    with open(log, "ab") as out:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)


def spawn(ws: Workspace, run_id: int) -> None:
    """Start a background watcher for one run (`orch watch ID --background`: its host's watcher, when its
    host's agent streams)."""
    _spawn(ws, ws.run_dir(run_id) / "watcher.log", ["watch", str(run_id)])


def spawn_host(ws: Workspace, host: str) -> None:
    """Start the host's watcher, which follows every active run there; its output in runs/watchers/. It
    starts without the CLI (hostwatch's own entry point): a fleet runs one per host."""
    _start(ws, host_lock_path(ws, host).with_suffix(".log"),
           ["-m", "orchestrator.runflow.hostwatch", host, "--hosts", str(ws.hosts_file)])


def watch_host_soon(ws: Workspace, host: Host) -> None:
    """A run is being prepared on the host: start its watcher now (when the host's agent streams and the
    inventory knows the host), so it follows the job from its first byte."""
    if streams(ws)(host.name) and not host_watched(ws, host.name):
        spawn_host(ws, host.name)


def streams(ws: Workspace) -> Callable[[str], bool]:
    """Whether a host of the inventory is followed by its host's watcher (its agent streams)."""
    try:
        hosts = Inventory.load(ws.hosts_file, ws.root).hosts
    except OrchError:
        hosts = {}
    return lambda name: name in hosts and executor_class(hosts[name]).streams


def ensure_watched(ws: Workspace, store: Store, runs: list[Run] | None = None, poll_max: float = 600.0) -> list[int]:
    """Start a watcher for each active run that nobody watches: its host's watcher for a host whose agent
    streams, else one of its own. The ids of the runs it started one for."""
    if runs is None:
        runs = store.list_runs(limit=100_000, statuses=[s.value for s in ACTIVE])
    started, hosts_started = [], set()
    streaming = streams(ws) if runs else None
    for run in runs:
        if run.status.terminal or watched_elsewhere(run, poll_max) or watched_here(ws, run.id):
            continue
        if streaming is not None and streaming(run.host):
            if run.host not in hosts_started and not host_watched(ws, run.host):
                spawn_host(ws, run.host)
            hosts_started.add(run.host)
        else:
            spawn(ws, run.id)
        started.append(run.id)
    for run in store.abandoned_ends():  # an ended run's end step whose claimer died: its host's watcher takes over
        streaming = streaming or streams(ws)
        if streaming(run.host) and run.host not in hosts_started and not host_watched(ws, run.host):
            spawn_host(ws, run.host)
            hosts_started.add(run.host)
    return started


def follow_record(ws: Workspace, store: Store, run_id: int, on_update: Callable[[Run], None] | None = None,
                  ready: Callable[[Run], bool] | None = None, sleep: Callable[[float], None] = time.sleep) -> Run:
    """Follow a run another process on this machine watches, by its record, until it ends (or, with
    `ready`, is ready by that rule) or nobody watches it any more."""
    while True:
        run = store.get_run(run_id)
        if on_update is not None:
            on_update(run)
        if run.status.terminal or (ready is not None and ready(run)):
            return run
        if not watched_here(ws, run_id):
            return run
        sleep(FOLLOW_S)
