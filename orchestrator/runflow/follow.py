"""Watching a run: the one watcher polls its host, others follow its record; orphans and refreshes."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..config.hosts import Host, Inventory
from ..config.workspace import Workspace
from ..errors import OrchError
from ..host import health
from ..host.polling import live_poll_max
from ..store import Store, lease
from ..store.controller import STALE_FACTOR
from ..store.record import ACTIVE, Run, Status
from .context import Job, open_run, watch_options
from .ending import complete_cancel, finish, settle_orphan
from .watch import Watcher
from .watching import (
    FOLLOW_S,
    FollowLock,
    WatchLock,
    follow_record,
    host_watched,
    spawn_host,
    watched_elsewhere,
    watched_here,
)


def watcher(ctx: Job, *, until_ready: bool = False, on_update: Callable[[Run], None] | None = None,
            sleep: Callable[[float], None] = time.sleep, live: bool = False) -> Watcher:
    opts = watch_options(ctx.pb, ctx.spec, ctx.host, until_ready)
    if live:  # a person is looking: news within seconds, whatever the backoff
        opts.poll_max = live_poll_max(opts.poll_min, opts.poll_max)
    update = (lambda w: on_update(w.run)) if on_update is not None else None
    return Watcher(ctx.store, ctx.run_id, ctx.executor, opts, on_update=update, sleep=sleep)


def watch(ctx: Job, *, until_ready: bool = False, on_update: Callable[[Run], None] | None = None,
          sleep: Callable[[float], None] = time.sleep, live: bool = False) -> Run:
    """Watch the run until it ends (or, with until_ready, is ready); an ended run is finished.

    On a host whose agent streams, the host's watcher follows the run and this process its record. Else
    only the run's watcher polls; while another process on this machine is that watcher, this one follows
    the record, and takes over when that process is gone.
    """
    ready = _ready_rule(ctx) if until_ready else None
    while True:
        run = ctx.refresh()
        if run.status.terminal:
            return finish(ctx)
        if ctx.executor.streams and run.launched and _inventory_host(ctx) == ctx.host:
            return _follow_host(ctx, until_ready, on_update, sleep)
        if ctx.lock is None:
            lock = WatchLock(ctx.ws, ctx.run_id)
            ctx.lock = lock if lock.acquire() else None
        if not run.launched:
            raise OrchError(f"run {run.id} never launched ({run.status})")
        if ctx.lock is not None:
            run = watcher(ctx, until_ready=until_ready, on_update=on_update, sleep=sleep,
                          live=live).run_until_done()
            ctx.record = run  # the watcher's last read
            return finish(ctx) if run.status.terminal else run
        run = ctx.record = follow_record(ctx.ws, ctx.store, ctx.run_id, on_update, ready, sleep)
        if run.status.terminal:
            return finish(ctx)  # its watcher did; finding nothing left to do
        if ready is not None and ready(run):
            return run


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


SPAWN_AGAIN_S = 10.0  # a host watcher just started takes a moment to hold its lock


def _follow_host(ctx: Job, until_ready: bool, on_update: Callable[[Run], None] | None,
                 sleep: Callable[[float], None]) -> Run:
    """Follow the run's record while its host's watcher follows the run (started here when missing)."""
    with FollowLock(ctx.ws, ctx.run_id):
        ctx.release()  # a starter's lock: the host's watcher takes the run over
        return _follow_record(ctx, until_ready, on_update, sleep)


def _follow_record(ctx: Job, until_ready: bool, on_update: Callable[[Run], None] | None,
                   sleep: Callable[[float], None]) -> Run:
    ready = _ready_rule(ctx) if until_ready else None
    spawned_at = -SPAWN_AGAIN_S
    while True:
        run = ctx.refresh()
        if on_update is not None:
            on_update(run)
        if run.status.terminal:
            return finish(ctx)
        if ready is not None and ready(run):
            return run
        now = time.monotonic()
        if (now - spawned_at >= SPAWN_AGAIN_S and not watched_here(ctx.ws, ctx.run_id)
                and not watched_elsewhere(run, watch_options(ctx.pb, ctx.spec, ctx.host).poll_max)
                and not host_watched(ctx.ws, ctx.host.name)):
            spawn_host(ctx.ws, ctx.host.name)
            spawned_at = now
        sleep(FOLLOW_S)


def keep_watching(ctx: Job, sleep: Callable[[float], None] = time.sleep) -> Run | None:
    """A background watcher's whole job: wait while the run's starter is at work, settle it if the
    starter died, then watch it to its end. None when another process watches it already."""
    with WatchLock(ctx.ws, ctx.run_id) as lock:
        if not lock.held:
            return None
        ctx.lock = lock
        while (run := ctx.refresh()).status in (Status.PENDING, Status.PREPARING, Status.LAUNCHING):
            starter = run.watched_by
            poll_max = watch_options(ctx.pb, ctx.spec, ctx.host).poll_max
            if starter is None or not starter.alive(run.heartbeat, STALE_FACTOR * poll_max):
                settle_orphan(ctx)
            else:
                sleep(1.0)
        lease.adopt(ctx.store, ctx.run_id)  # the lease names a live controller again
        run = watch(ctx)
        ctx.lock = None
        return run


def poll(ctx: Job) -> Run:
    """Poll the run's host once; an ended run is finished."""
    w = watcher(ctx)
    w.poll_once()
    ctx.record = w.run
    return finish(ctx) if w.run.status.terminal else w.run


def probe_orphan(ws: Workspace, store: Store, run: Run) -> None:
    """The lease's probe, which asks the host: settle a run whose controller died and poll it once; if its
    job has ended, end it (which frees its lease). A run that ended while whoever ended it died has its
    lease freed (its end steps left done first) once the host shows its job is not running."""
    try:
        ctx = open_run(ws, store, run, any_spec=True)
        if ctx.refresh().status.terminal:
            finish_if_over(ctx)
        elif ctx.run.status is Status.CANCELLING:  # its stop is still to be done: the host says if it can be
            complete_cancel(ctx, look_first=False)
        elif settle_orphan(ctx).status.live:
            poll(ctx)
    except OrchError as exc:  # the host cannot say: the lease stays, the caller reports the holder
        store.add_event(run.id, "warning", f"lease check: {exc}")


def finish_if_over(ctx: Job) -> None:
    """An ended run whose lease outlived whoever was ending it: finished (its lease freed) unless its host
    shows its job still running — a run that never launched has none."""
    job = ctx.run.job
    if job is not None and ctx.executor.processes:
        state = ctx.executor.poll(ctx.paths, job, 0, 0)
        if state.alive:  # its record says ended, its host says otherwise: the lease stays
            return
    finish(ctx)


def refresh(ws: Workspace, store: Store, ids: list[int] | None, timeout: float,
            on_error: Callable[[str], None]) -> None:
    """Poll every active run's host once; hosts in parallel, each with its own store connection and
    `timeout` seconds: a host that does not answer is reported and left behind."""
    from ..host.fleet import fan_out

    runs = [store.get_run(i) for i in ids] if ids else store.list_runs(limit=10_000, statuses=[s.value for s in ACTIVE])
    runs = [r for r in runs if r.launched and not r.status.terminal]
    inv = Inventory.load(ws.hosts_file, ws.root)
    by_host: dict[str, list[Run]] = {}
    for r in runs:
        by_host.setdefault(r.host, []).append(r)

    def poll_host(name: str) -> None:
        own = Store(ws.db_path)
        try:
            for r in by_host[name]:
                try:
                    poll(open_run(ws, own, r.id, inv))
                except OrchError as exc:
                    on_error(f"run {r.id} on {name}: {exc}")
        finally:
            own.close()

    for name, res in fan_out({n: n for n in by_host}, poll_host, timeout).items():
        if isinstance(res, OrchError):
            on_error(f"{name}: {res}; runs {', '.join(str(r.id) for r in by_host[name])} not refreshed")
