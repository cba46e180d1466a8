"""Every active run is always watched: who watches a run, and a watcher for a host nobody watches.

Each host of the inventory (an SSH host, this machine, a Slurm cluster's login node) has one watcher per
workspace, `python -m orchestrator.watch.hostwatch NAME` (`orch watch-host NAME` runs the same), found by
its lock `runs/watchers/<host>.lock`; it follows every active run there, holding each run's lock,
`runs/<id>/watch.lock`, while it does. It is started for a run nobody watches — while a run is prepared,
and from any `orch status` that finds an active run unwatched (its watcher was killed, the machine
rebooted). A run on a host no inventory knows (one made in process) is watched by a host watcher in the
process that follows it (orchestrator.watch.follow). Everyone else follows the run by its record.

The locks are flocks, gone with their process, so a duplicate watcher is harmless: it exits at once.
Nothing to install or supervise: a host's watcher lives as long as the host has active runs.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Self

from ..config.hosts import Host, Inventory
from ..config.workspace import Workspace
from ..errors import OrchError
from ..store import Store
from ..store.controller import STALE_FACTOR
from ..store.record import ACTIVE, RunRecord

# How often a follower reads the record. SQLite tells no other process of a commit, so a follower looks
# (at one number, data_version, unless something was written); a terminal redraws its line every second
# anyway (elapsed time, "no news for N s").
FOLLOW_S = 0.5


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


def await_followers(ws: Workspace, run_id: int) -> None:
    """Wait until nobody on this machine follows the run's record (holds its follow lock): a follower runs
    the end steps itself and shows their outcome. The kernel wakes this when the last follower lets go."""
    fd = os.open(ws.run_dir(run_id) / "follow.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    finally:
        os.close(fd)


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


def watched_elsewhere(run: RunRecord, poll_max: float) -> bool:
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
    """Start a background watcher for one run (`orch watch ID --background`: its host's watcher)."""
    _spawn(ws, ws.run_dir(run_id) / "watcher.log", ["watch", str(run_id)])


def spawn_host(ws: Workspace, host: str) -> None:
    """Start the host's watcher, which follows every active run there; its output in runs/watchers/. It
    starts without the CLI (hostwatch's own entry point): a fleet runs one per host."""
    _start(ws, host_lock_path(ws, host).with_suffix(".log"),
           ["-m", "orchestrator.watch.hostwatch", host, "--hosts", str(ws.hosts_file)])


def watch_host_soon(ws: Workspace, host: Host) -> None:
    """A run is being prepared on the host: start its watcher now (when the inventory has this host), so it
    follows the job from its first byte. A host made in process (not the inventory's, even by the same
    name) is watched by the process that follows its run."""
    try:
        known = Inventory.load(ws.hosts_file, ws.root).hosts.get(host.name)
    except OrchError:
        known = None
    if known == host and not host_watched(ws, host.name):
        spawn_host(ws, host.name)


def in_inventory(ws: Workspace) -> Callable[[str], bool]:
    """Whether a host is in the workspace's inventory: only such a host's watcher runs in a process of its own."""
    try:
        hosts = Inventory.load(ws.hosts_file, ws.root).hosts
    except OrchError:
        hosts = {}
    return lambda name: name in hosts


def ensure_watched(ws: Workspace, store: Store, runs: list[RunRecord] | None = None, poll_max: float = 600.0) -> list[int]:
    """Start the host's watcher for each active run that nobody watches, on a host of the inventory (a run on
    a host made in process is watched by the process that follows it). The ids of those runs."""
    if runs is None:
        runs = store.list_runs(limit=100_000, statuses=[s.value for s in ACTIVE])
    started, hosts_started = [], set()
    known = in_inventory(ws)
    for run in runs:
        if (run.status.terminal or not known(run.host) or watched_elsewhere(run, poll_max)
                or watched_here(ws, run.id)):
            continue
        if run.host not in hosts_started and not host_watched(ws, run.host):
            spawn_host(ws, run.host)
        hosts_started.add(run.host)
        started.append(run.id)
    for run in store.abandoned_ends():  # an ended run's end step whose claimer died: its host's watcher takes over
        if known(run.host) and run.host not in hosts_started and not host_watched(ws, run.host):
            spawn_host(ws, run.host)
            hosts_started.add(run.host)
    return started
