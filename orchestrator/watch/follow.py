"""Following a run: its host's watcher records it, this process follows the record.

`orch run` and `orch watch` in a terminal and a sweep's controller follow a launched run by its record,
holding its follow lock (so the end steps run here, and the summary comes after them). The host's
watcher is started when missing; for a host no inventory knows (one made in process) it runs on a thread
of this process, for as long as this process follows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..config.hosts import Host, Inventory
from ..errors import OrchError
from ..host import health
from ..runflow import Run, finish, watch_options
from ..runflow.recorder import say
from ..runflow.watching import FOLLOW_S, FollowLock, host_watched, spawn_host, watched_elsewhere, watched_here
from ..store.record import RunRecord
from .hostwatch import HostWatcher

SPAWN_AGAIN_S = 10.0  # a host watcher just started takes a moment to hold its lock
READ_ANYWAY_S = 10.0


def watch(run: Run, *, until_ready: bool = False, on_update: Callable[[RunRecord], None] | None = None,
          sleep: Callable[[float], None] = time.sleep) -> RunRecord:
    """Follow the run until it ends (or, with until_ready, is ready); an ended run is finished."""
    record = run.refresh()
    if record.status.terminal:
        return finish(run)
    if not record.launched:
        raise OrchError(f"run {record.id} never launched ({record.status})")
    if _inventory_host(run) == run.host:
        with FollowLock(run.ws, run.run_id):
            run.release()  # a starter's lock: the host's watcher takes the run over
            return _follow_record(run, until_ready, on_update, sleep, _Spawned(run).keep)
    in_process = _InProcess(run)
    try:
        with FollowLock(run.ws, run.run_id):
            run.release()
            return _follow_record(run, until_ready, on_update, sleep, in_process.keep)
    finally:  # once the follow lock is let go: an end under way there waits for this follower
        in_process.stop()


def _ready_rule(run: Run) -> Callable[[RunRecord], bool]:
    """health.ready read from the run's record: its phase, and its endpoint's last answer when it has one."""
    if watch_options(run.pb, run.spec, run.host).health is None:
        return lambda record: health.ready(record.phase, None)
    return lambda record: health.ready(record.phase, health.answering(run.store.events(record.id)))


def _inventory_host(run: Run) -> Host | None:
    """The run's host as the workspace's inventory has it (the host's watcher reads that one); None for a
    host made in process and known to no inventory."""
    try:
        return Inventory.load(run.ws.hosts_file, run.ws.root).hosts.get(run.host.name)
    except OrchError:
        return None


class _Spawned:
    """The host's watcher as a process of its own, started again whenever nobody watches the run."""

    def __init__(self, run: Run):
        self.run = run
        self.spawned_at = -SPAWN_AGAIN_S

    def keep(self, record: RunRecord) -> None:
        run, now = self.run, time.monotonic()
        if (now - self.spawned_at >= SPAWN_AGAIN_S and not watched_here(run.ws, run.run_id)
                and not watched_elsewhere(record, watch_options(run.pb, run.spec, run.host).poll_max)
                and not host_watched(run.ws, run.host.name)):
            spawn_host(run.ws, run.host.name)
            self.spawned_at = now


class _InProcess:
    """The host's watcher on a thread of this process, for a host no inventory knows (no process of its own
    could know the host): it follows the host's runs while this process follows the run, and is started
    again should it end meanwhile (another process held the host's lock, which is gone now)."""

    def __init__(self, run: Run):
        self.ws, self.host, self.busy_timeout_s = run.ws, run.host, run.store.busy_timeout_s
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.started_at = -SPAWN_AGAIN_S

    def keep(self, run: RunRecord) -> None:
        now = time.monotonic()
        if (self.thread is None or not self.thread.is_alive()) and now - self.started_at >= SPAWN_AGAIN_S:
            self.thread = threading.Thread(target=self._serve, name=f"orch-watch-{self.host.name}", daemon=True)
            self.thread.start()
            self.started_at = now

    def _serve(self) -> None:
        watcher = HostWatcher(self.ws, self.host.name, Inventory({self.host.name: self.host}),
                              busy_timeout_s=self.busy_timeout_s)  # a store of its own, as patient as the caller's
        watcher.stopping = self.stopping
        try:
            watcher.serve()
        except OrchError as exc:  # said; started again by `keep` while the run is followed
            say(f"orch: the watcher of {self.host.name}: {exc}")

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()


def _follow_record(run: Run, until_ready: bool, on_update: Callable[[RunRecord], None] | None,
                   sleep: Callable[[float], None], keep_watched: Callable[[RunRecord], None]) -> RunRecord:
    ready = _ready_rule(run) if until_ready else None
    run.store.changed()  # (the first call says so in any case)
    record, read_at = run.refresh(), time.monotonic()
    while True:
        # the row is read again once another connection wrote (see FOLLOW_S), and now and then in any case:
        # a write through this process's own connection does not count as a change
        if run.store.changed() or time.monotonic() - read_at >= READ_ANYWAY_S:
            record, read_at = run.refresh(), time.monotonic()
        if on_update is not None:
            on_update(record)
        if record.status.terminal:
            return finish(run)
        if ready is not None and ready(record):
            return record
        keep_watched(record)
        sleep(FOLLOW_S)
