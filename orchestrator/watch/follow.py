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
from ..runflow import Job, finish, watch_options
from ..runflow.recorder import say
from ..runflow.watching import FOLLOW_S, FollowLock, host_watched, spawn_host, watched_elsewhere, watched_here
from ..store.record import Run
from .hostwatch import HostWatcher

SPAWN_AGAIN_S = 10.0  # a host watcher just started takes a moment to hold its lock
READ_ANYWAY_S = 10.0


def watch(ctx: Job, *, until_ready: bool = False, on_update: Callable[[Run], None] | None = None,
          sleep: Callable[[float], None] = time.sleep) -> Run:
    """Follow the run until it ends (or, with until_ready, is ready); an ended run is finished."""
    run = ctx.refresh()
    if run.status.terminal:
        return finish(ctx)
    if not run.launched:
        raise OrchError(f"run {run.id} never launched ({run.status})")
    if _inventory_host(ctx) == ctx.host:
        with FollowLock(ctx.ws, ctx.run_id):
            ctx.release()  # a starter's lock: the host's watcher takes the run over
            return _follow_record(ctx, until_ready, on_update, sleep, _Spawned(ctx).keep)
    in_process = _InProcess(ctx)
    try:
        with FollowLock(ctx.ws, ctx.run_id):
            ctx.release()
            return _follow_record(ctx, until_ready, on_update, sleep, in_process.keep)
    finally:  # once the follow lock is let go: an end under way there waits for this follower
        in_process.stop()


def _ready_rule(ctx: Job) -> Callable[[Run], bool]:
    """health.ready read from the run's record: its phase, and its endpoint's last answer when it has one."""
    if watch_options(ctx.pb, ctx.spec, ctx.host).health is None:
        return lambda run: health.ready(run.phase, None)
    return lambda run: health.ready(run.phase, health.answering(ctx.store.events(run.id)))


def _inventory_host(ctx: Job) -> Host | None:
    """The run's host as the workspace's inventory has it (the host's watcher reads that one); None for a
    host made in process and known to no inventory."""
    try:
        return Inventory.load(ctx.ws.hosts_file, ctx.ws.root).hosts.get(ctx.host.name)
    except OrchError:
        return None


class _Spawned:
    """The host's watcher as a process of its own, started again whenever nobody watches the run."""

    def __init__(self, ctx: Job):
        self.ctx = ctx
        self.spawned_at = -SPAWN_AGAIN_S

    def keep(self, run: Run) -> None:
        ctx, now = self.ctx, time.monotonic()
        if (now - self.spawned_at >= SPAWN_AGAIN_S and not watched_here(ctx.ws, ctx.run_id)
                and not watched_elsewhere(run, watch_options(ctx.pb, ctx.spec, ctx.host).poll_max)
                and not host_watched(ctx.ws, ctx.host.name)):
            spawn_host(ctx.ws, ctx.host.name)
            self.spawned_at = now


class _InProcess:
    """The host's watcher on a thread of this process, for a host no inventory knows (no process of its own
    could know the host): it follows the host's runs while this process follows the run, and is started
    again should it end meanwhile (another process held the host's lock, which is gone now)."""

    def __init__(self, ctx: Job):
        self.ws, self.host, self.busy_timeout_s = ctx.ws, ctx.host, ctx.store.busy_timeout_s
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.started_at = -SPAWN_AGAIN_S

    def keep(self, run: Run) -> None:
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


def _follow_record(ctx: Job, until_ready: bool, on_update: Callable[[Run], None] | None,
                   sleep: Callable[[float], None], keep_watched: Callable[[Run], None]) -> Run:
    ready = _ready_rule(ctx) if until_ready else None
    ctx.store.changed()  # (the first call says so in any case)
    run, read_at = ctx.refresh(), time.monotonic()
    while True:
        # the row is read again once another connection wrote (see FOLLOW_S), and now and then in any case:
        # a write through this process's own connection does not count as a change
        if ctx.store.changed() or time.monotonic() - read_at >= READ_ANYWAY_S:
            run, read_at = ctx.refresh(), time.monotonic()
        if on_update is not None:
            on_update(run)
        if run.status.terminal:
            return finish(ctx)
        if ready is not None and ready(run):
            return run
        keep_watched(run)
        sleep(FOLLOW_S)
