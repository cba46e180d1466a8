"""One-shot looks at a run's host: `orch status --refresh` and the lease's orphan probe.

Each is the agent's single read of the job's state, recorded by the recorder as its host's watcher would
record it; an ended run is finished. Following a run to its end is the host watcher's (orchestrator.watch).
"""

from __future__ import annotations

from collections.abc import Callable

from ..config.hosts import Inventory
from ..config.workspace import Workspace
from ..errors import OrchError
from ..store import Store
from ..store.record import ACTIVE, RunRecord, Status
from .context import Run, open_run, watch_options
from .ending import complete_cancel, failed_running, finish, settle_orphan
from .recorder import Recorder


def poll(run: Run) -> RunRecord:
    """Read the run's state on its host once and record it; an ended run is finished."""
    rec = Recorder(run.store, run.run_id, run.executor, watch_options(run.pb, run.spec, run.host))
    rec.look()
    run.last_read = rec.record
    return finish(run) if rec.record.status.terminal else rec.record


def probe_orphan(ws: Workspace, store: Store, record: RunRecord) -> None:
    """The lease's probe, which asks the host: settle a run whose controller died and look at it once; if its
    job has ended, end it (which frees its lease). A run that ended while whoever ended it died has its
    lease freed (its end steps left done first) once the host shows its job is not running."""
    try:
        run = open_run(ws, store, record, any_spec=True)
        if run.refresh().status.terminal:
            finish_if_over(run)
        elif run.record.status is Status.CANCELLING:  # its stop is still to be done: the host says if it can be
            complete_cancel(run, look_first=False)
        elif settle_orphan(run).status.live:
            poll(run)
    except OrchError as exc:  # the host cannot say: the lease stays, the caller reports the holder
        store.add_event(record.id, "warning", f"lease check: {exc}")


def finish_if_over(run: Run) -> None:
    """An ended run whose lease outlived whoever was ending it: finished (its lease freed) unless its host
    shows its job still running — a run that never launched has none — and its end steps would not stop it
    (a run that failed while its job ran, whose stop was never done)."""
    job = run.record.job
    stops_it = failed_running(run.record) and ("stop" not in run.record.end_steps or "stop" in run.record.end_claims)
    if job is not None and run.executor.processes and not stops_it:
        state = run.executor.poll(run.paths, job, 0, 0)
        if state.alive:  # its record says ended, its host says otherwise: the lease stays
            return
    finish(run)


def refresh(ws: Workspace, store: Store, ids: list[int] | None, timeout: float,
            on_error: Callable[[str], None]) -> None:
    """Look at every active run's host once; hosts in parallel, each with its own store connection and
    `timeout` seconds: a host that does not answer is reported and left behind."""
    from ..host.fleet import fan_out

    runs = [store.get_run(i) for i in ids] if ids else store.list_runs(limit=10_000, statuses=[s.value for s in ACTIVE])
    runs = [r for r in runs if r.launched and not r.status.terminal]
    inv = Inventory.load(ws.hosts_file, ws.root)
    by_host: dict[str, list[RunRecord]] = {}
    for r in runs:
        by_host.setdefault(r.host, []).append(r)

    def look_at_host(name: str) -> None:
        own = Store(ws.db_path)
        try:
            for r in by_host[name]:
                try:
                    poll(open_run(ws, own, r.id, inv))
                except OrchError as exc:
                    on_error(f"run {r.id} on {name}: {exc}")
        finally:
            own.close()

    for name, res in fan_out({n: n for n in by_host}, look_at_host, timeout).items():
        if isinstance(res, OrchError):
            on_error(f"{name}: {res}; runs {', '.join(str(r.id) for r in by_host[name])} not refreshed")
