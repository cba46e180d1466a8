"""A sweep's rows: the sweep, its points and its events (kept by store.sweeps). Every status change goes
through `transition_sweep` or `transition_point`, which write the status and its event in one transaction."""

from __future__ import annotations

import time

from ..errors import NotFound, OrchError, TransitionError
from ..store import Store
from ..store import sweeps as stored_sweeps
from ..store.controller import Controller
from ..store.record import RunRecord
from ..store.sweeps import add_event
from . import policy
from .plan import Plan
from .record import POINT_ALLOWED, SWEEP_ALLOWED, Fault, PointRow, PointStatus, SweepRow, SweepStatus


# events ----------------------------------------------------------------------------------------------
def on_run_ended(store: Store, sweep_id: int, point: int, run_id: int) -> None:
    """Called when a point's run ends: an event with the run's status."""
    run = store.get_run(run_id)
    add_event(store, sweep_id, "run_ended", f"point {point}: run {run_id} {run.status}",
              {"point": point, "run_id": run_id, "status": run.status.value})


# reading ---------------------------------------------------------------------------------------------
def sweep(store: Store, sweep_id: int) -> SweepRow:
    row = stored_sweeps.sweep(store, sweep_id)
    if row is None:
        raise NotFound(f"no sweep {sweep_id}")
    return SweepRow.from_row(row)


def points(store: Store, sweep_id: int) -> list[PointRow]:
    return [PointRow.from_row(r) for r in stored_sweeps.points(store, sweep_id)]


def point(store: Store, sweep_id: int, index: int) -> PointRow:
    row = stored_sweeps.point(store, sweep_id, index)
    if row is None:
        raise NotFound(f"no point {index} in sweep {sweep_id}")
    return PointRow.from_row(row)


def resolve(store: Store, ref: str | None) -> int:
    """A sweep by id or by name (the newest of that name); None: the newest sweep."""
    if ref is None:
        newest = stored_sweeps.newest(store)
        if newest is None:
            raise NotFound("no sweeps yet")
        return newest
    if ref.isascii() and ref.isdigit() and len(ref) <= 18:  # not '²', nor past SQLite's integers
        sweep(store, int(ref))
        return int(ref)
    found = stored_sweeps.newest(store, ref)
    if found is None:
        raise NotFound(f"no sweep {ref!r}")
    return found


def latest_run(store: Store, sweep_id: int, key: str) -> RunRecord | None:
    run_id = stored_sweeps.latest_run_of_point(store, sweep_id, key)
    return store.get_run(run_id) if run_id is not None else None


def cancelled(store: Store, sweep_id: int, index: int) -> bool:
    """The point, or its whole sweep, was cancelled."""
    of_sweep, of_point = stored_sweeps.statuses(store, sweep_id, index)
    return SweepStatus(of_sweep) is SweepStatus.CANCELLED or PointStatus(of_point) is PointStatus.CANCELLED


# status changes --------------------------------------------------------------------------------------
def transition_sweep(store: Store, sweep_id: int, to: SweepStatus, message: str = "") -> None:
    """Move a sweep to `to` and record it as an event, in one transaction; refuses a move not allowed."""
    with store.tx():
        current = sweep(store, sweep_id).status
        if to not in SWEEP_ALLOWED[current]:
            raise TransitionError(f"sweep {sweep_id} cannot go from {current} to {to}")
        stored_sweeps.update(store, sweep_id, status=to.value)
        add_event(store, sweep_id, "status", f"{to}: {message}" if message else to.value,
                  {"from": current.value, "to": to.value})


def transition_point(store: Store, sweep_id: int, index: int, to: PointStatus, *, reason: str | None = None,
                     fault: Fault | None = None, run_id: int | None = None, attempt: bool = False) -> None:
    """Move a point to `to` (its fault and reason with it; an attempt counted when it starts one) and record
    it as an event, in one transaction; refuses a move not allowed."""
    if (fault is not None) != (to is PointStatus.FAILED):
        raise ValueError(f"a {to} point with fault {fault}: only a failed point has a fault, and always one")
    with store.tx():
        current = point(store, sweep_id, index).status
        if to not in POINT_ALLOWED[current]:
            raise TransitionError(f"sweep {sweep_id} point {index} cannot go from {current} to {to}")
        stored_sweeps.set_point_status(store, sweep_id, index, to.value, fault=fault.value if fault else None, reason=reason,
                              run_id=run_id, attempt=attempt)
        add_event(store, sweep_id, "point", f"point {index}: {to}" + (f" ({fault})" if fault else ""),
                  {"point": index, "from": current.value, "to": to.value})


# the controller --------------------------------------------------------------------------------------
def check_not_running(row: SweepRow) -> None:
    """Refuse a second controller while a live one (another process) holds the sweep."""
    who = row.controller
    if who is not None and not who.is_mine and row.controller_alive():
        raise OrchError(f"sweep {row.id} ({row.name}) is already running (controller pid {who.pid} on "
                        f"{who.hostname}); `orch sweep status {row.id}` shows it")


def claim(store: Store, sweep_id: int) -> None:
    """Make this process the sweep's controller, unless a live one already is; what did not finish
    last time is queued again."""
    with store.tx():
        row = sweep(store, sweep_id)
        check_not_running(row)
        if row.status is not SweepStatus.RUNNING:  # still running: its controller died, this one takes over
            transition_sweep(store, sweep_id, SweepStatus.RUNNING)
        stored_sweeps.update(store, sweep_id, controller=str(Controller.me()), heartbeat=time.time(), ended_at=None)
        for pt in points(store, sweep_id):
            if policy.runs_again(pt.status, pt.fault):
                transition_point(store, sweep_id, pt.index, PointStatus.QUEUED)


def release(store: Store, sweep_id: int) -> None:
    """The sweep has no controller any more: it ended (or was cancelled with nobody running it)."""
    stored_sweeps.update(store, sweep_id, ended_at=time.time(), controller=None)


# writing ---------------------------------------------------------------------------------------------
def register(store: Store, p: Plan) -> int:
    """The sweep's id: the existing one for this name, file content and instance, or a new one with its points."""
    with store.tx():
        found = stored_sweeps.find(store, p.file.name, p.file_hash, p.instance)
        if found is not None:
            return found
        sweep_id = stored_sweeps.create(
            store, name=p.file.name, file_hash=p.file_hash, instance=p.instance, path=str(p.path),
            playbook=p.file.playbook, doc=p.file.model_dump(mode="json"), notify=p.file.notify,
            status=SweepStatus.QUEUED.value,
            points=[{"index": pt.index, "point": pt.key, "host": pt.host, "gpus": pt.spec.gpus,
                     "status": PointStatus.QUEUED.value} for pt in p.points])
        what = f"a search of {p.search.trials} trials" if p.search else f"{len(p.points)} points"
        add_event(store, sweep_id, "created", f"{what} on {', '.join(h.name for h in p.hosts)}")
    return sweep_id


def settle_point(store: Store, sweep_id: int, index: int, to: PointStatus, *, reason: str | None = None,
                 fault: Fault | None = None, run_id: int | None = None) -> bool:
    """A controller moves its point, unless a `sweep cancel` cancelled it meanwhile: that stands."""
    with store.tx():
        if point(store, sweep_id, index).status is PointStatus.CANCELLED:
            return False
        transition_point(store, sweep_id, index, to, reason=reason, fault=fault, run_id=run_id)
    return True


def start_point(store: Store, sweep_id: int, index: int) -> bool:
    """The point starts an attempt, unless it (or its sweep) was cancelled: then it ends cancelled."""
    with store.tx():
        if cancelled(store, sweep_id, index):
            if point(store, sweep_id, index).status is not PointStatus.CANCELLED:
                transition_point(store, sweep_id, index, PointStatus.CANCELLED, reason="cancelled")
            return False
        transition_point(store, sweep_id, index, PointStatus.RUNNING, attempt=True)
    return True


def attach_run(store: Store, sweep_id: int, index: int, run_id: int) -> bool:
    """Record the point's run; False when the point or its sweep was cancelled meanwhile."""
    with store.tx():
        stored_sweeps.set_point_run(store, sweep_id, index, run_id)
        return not cancelled(store, sweep_id, index)


def cancel_points(store: Store, sweep_id: int, among: set[PointStatus], reason: str) -> int:
    """Cancel the points whose status is among these; how many were."""
    with store.tx():
        hit = [pt for pt in points(store, sweep_id) if pt.status in among]
        for pt in hit:
            transition_point(store, sweep_id, pt.index, PointStatus.CANCELLED, reason=reason)
    return len(hit)
