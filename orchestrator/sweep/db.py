"""A sweep's rows: the sweep, its points and its events. Every status change goes through
`transition_sweep` or `transition_point`, which write the status and its event in one transaction."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from ..errors import NotFound, OrchError, TransitionError
from ..store import Store
from ..store.controller import Controller
from ..store.record import ACTIVE, Run
from . import policy
from .plan import Plan
from .record import POINT_ALLOWED, SWEEP_ALLOWED, Fault, PointRow, PointStatus, SweepRow, SweepStatus


def _dicts(cur: sqlite3.Cursor) -> list[dict[str, Any]]:
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


# events ----------------------------------------------------------------------------------------------
def add_event(store: Store, sweep_id: int | None, kind: str, message: str = "", data: Any = None) -> None:
    with store.tx() as c:
        c.execute("INSERT INTO sweep_events (sweep_id, ts, kind, message, data) VALUES (?, ?, ?, ?, ?)",
                  (sweep_id, time.time(), kind, message, json.dumps(data) if data is not None else None))


def events(store: Store, sweep_id: int) -> list[dict[str, Any]]:
    rows = store.conn.execute("SELECT ts, kind, message, data FROM sweep_events WHERE sweep_id = ? ORDER BY id",
                              (sweep_id,))
    return [{"ts": ts, "kind": k, "message": m, "data": json.loads(d) if d else None} for ts, k, m, d in rows]


def on_run_ended(store: Store, sweep_id: int, point: int, run_id: int) -> None:
    """Called when a point's run ends: an event with the run's status."""
    run = store.get_run(run_id)
    add_event(store, sweep_id, "run_ended", f"point {point}: run {run_id} {run.status}",
              {"point": point, "run_id": run_id, "status": run.status.value})


# reading ---------------------------------------------------------------------------------------------
def sweep(store: Store, sweep_id: int) -> SweepRow:
    rows = _dicts(store.conn.execute("SELECT * FROM sweeps WHERE id = ?", (sweep_id,)))
    if not rows:
        raise NotFound(f"no sweep {sweep_id}")
    return SweepRow.from_row(rows[0])


def points(store: Store, sweep_id: int) -> list[PointRow]:
    cur = store.conn.execute("SELECT * FROM sweep_points WHERE sweep_id = ? ORDER BY idx", (sweep_id,))
    return [PointRow.from_row(r) for r in _dicts(cur)]


def point(store: Store, sweep_id: int, index: int) -> PointRow:
    cur = store.conn.execute("SELECT * FROM sweep_points WHERE sweep_id = ? AND idx = ?", (sweep_id, index))
    rows = _dicts(cur)
    if not rows:
        raise NotFound(f"no point {index} in sweep {sweep_id}")
    return PointRow.from_row(rows[0])


def resolve(store: Store, ref: str | None) -> int:
    """A sweep by id or by name (the newest of that name); None: the newest sweep."""
    if ref is None:
        row = store.conn.execute("SELECT MAX(id) FROM sweeps").fetchone()
        if row[0] is None:
            raise NotFound("no sweeps yet")
        return int(row[0])
    if ref.isascii() and ref.isdigit() and len(ref) <= 18:  # not '²', nor past SQLite's integers
        sweep(store, int(ref))
        return int(ref)
    row = store.conn.execute("SELECT MAX(id) FROM sweeps WHERE name = ?", (ref,)).fetchone()
    if row[0] is None:
        raise NotFound(f"no sweep {ref!r}")
    return int(row[0])


def newest_of(store: Store, name: str, file_hash: str) -> int | None:
    """The newest sweep of this file, whatever its instance."""
    row = store.conn.execute("SELECT MAX(id) FROM sweeps WHERE name = ? AND file_hash = ?",
                             (name, file_hash)).fetchone()
    return None if row[0] is None else int(row[0])


def latest_run(store: Store, sweep_id: int, key: str) -> Run | None:
    row = store.conn.execute("SELECT MAX(id) FROM runs WHERE sweep_id = ? AND point = ?", (sweep_id, key)).fetchone()
    return store.get_run(row[0]) if row[0] is not None else None


def runs_of(store: Store, sweep_id: int, key: str) -> int:
    return int(store.conn.execute("SELECT COUNT(*) FROM runs WHERE sweep_id = ? AND point = ?",
                                  (sweep_id, key)).fetchone()[0])


def active_runs(store: Store, sweep_id: int) -> list[int]:
    """The sweep's runs that launched and have not ended."""
    marks = ",".join("?" * len(ACTIVE))
    return [r[0] for r in store.conn.execute(
        f"SELECT id FROM runs WHERE sweep_id = ? AND pid IS NOT NULL AND status IN ({marks})",
        (sweep_id, *[s.value for s in ACTIVE]))]


def cancelled(store: Store, sweep_id: int, index: int) -> bool:
    """The point, or its whole sweep, was cancelled."""
    row = store.conn.execute(
        "SELECT s.status, p.status FROM sweeps s JOIN sweep_points p ON p.sweep_id = s.id"
        " WHERE s.id = ? AND p.idx = ?", (sweep_id, index)).fetchone()
    return SweepStatus(row[0]) is SweepStatus.CANCELLED or PointStatus(row[1]) is PointStatus.CANCELLED


# status changes --------------------------------------------------------------------------------------
def transition_sweep(store: Store, sweep_id: int, to: SweepStatus, message: str = "") -> None:
    """Move a sweep to `to` and record it as an event, in one transaction; refuses a move not allowed."""
    with store.tx() as c:
        current = sweep(store, sweep_id).status
        if to not in SWEEP_ALLOWED[current]:
            raise TransitionError(f"sweep {sweep_id} cannot go from {current} to {to}")
        c.execute("UPDATE sweeps SET status = ? WHERE id = ?", (to.value, sweep_id))
        add_event(store, sweep_id, "status", f"{to}: {message}" if message else to.value,
                  {"from": current.value, "to": to.value})


def transition_point(store: Store, sweep_id: int, index: int, to: PointStatus, *, reason: str | None = None,
                     fault: Fault | None = None, run_id: int | None = None, attempt: bool = False) -> None:
    """Move a point to `to` (its fault and reason with it; an attempt counted when it starts one) and record
    it as an event, in one transaction; refuses a move not allowed."""
    if (fault is not None) != (to is PointStatus.FAILED):
        raise ValueError(f"a {to} point with fault {fault}: only a failed point has a fault, and always one")
    with store.tx() as c:
        current = point(store, sweep_id, index).status
        if to not in POINT_ALLOWED[current]:
            raise TransitionError(f"sweep {sweep_id} point {index} cannot go from {current} to {to}")
        c.execute("UPDATE sweep_points SET status = ?, fault = ?, reason = ?, run_id = COALESCE(?, run_id),"
                  " attempts = attempts + ? WHERE sweep_id = ? AND idx = ?",
                  (to.value, fault.value if fault else None, reason, run_id, int(attempt), sweep_id, index))
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
    with store.tx() as c:
        row = sweep(store, sweep_id)
        check_not_running(row)
        if row.status is not SweepStatus.RUNNING:  # still running: its controller died, this one takes over
            transition_sweep(store, sweep_id, SweepStatus.RUNNING)
        c.execute("UPDATE sweeps SET controller = ?, heartbeat = ?, ended_at = NULL WHERE id = ?",
                  (str(Controller.me()), time.time(), sweep_id))
        for pt in points(store, sweep_id):
            if policy.runs_again(pt.status, pt.fault):
                transition_point(store, sweep_id, pt.index, PointStatus.QUEUED)


def release(store: Store, sweep_id: int) -> None:
    """The sweep has no controller any more: it ended (or was cancelled with nobody running it)."""
    with store.tx() as c:
        c.execute("UPDATE sweeps SET ended_at = ?, controller = NULL WHERE id = ?", (time.time(), sweep_id))


def heartbeat(store: Store, sweep_id: int, now: float) -> None:
    with store.tx() as c:
        c.execute("UPDATE sweeps SET heartbeat = ? WHERE id = ?", (now, sweep_id))


# writing ---------------------------------------------------------------------------------------------
def register(store: Store, p: Plan) -> int:
    """The sweep's id: the existing one for this name, file content and instance, or a new one with its points."""
    with store.tx() as c:
        row = c.execute("SELECT id FROM sweeps WHERE name = ? AND file_hash = ? AND instance = ?",
                        (p.file.name, p.file_hash, p.instance)).fetchone()
        if row:
            return int(row[0])
        cur = c.execute(
            "INSERT INTO sweeps (name, file_hash, instance, path, playbook, doc, notify, status, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (p.file.name, p.file_hash, p.instance, str(p.path), p.file.playbook, p.file.model_dump_json(),
             json.dumps(p.file.notify), SweepStatus.QUEUED.value, time.time()),
        )
        sweep_id = int(cur.lastrowid or 0)
        c.executemany(
            "INSERT INTO sweep_points (sweep_id, idx, point, host, gpus, status, attempts) VALUES (?, ?, ?, ?, ?, ?, 0)",
            [(sweep_id, pt.index, pt.key, pt.host, json.dumps(pt.spec.gpus) if pt.spec.gpus is not None else None,
              PointStatus.QUEUED.value) for pt in p.points],
        )
        add_event(store, sweep_id, "created", f"{len(p.points)} points on {', '.join(h.name for h in p.hosts)}")
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
    with store.tx() as c:
        c.execute("UPDATE sweep_points SET run_id = ? WHERE sweep_id = ? AND idx = ?", (run_id, sweep_id, index))
        return not cancelled(store, sweep_id, index)


def cancel_points(store: Store, sweep_id: int, among: set[PointStatus], reason: str) -> int:
    """Cancel the points whose status is among these; how many were."""
    with store.tx():
        hit = [pt for pt in points(store, sweep_id) if pt.status in among]
        for pt in hit:
            transition_point(store, sweep_id, pt.index, PointStatus.CANCELLED, reason=reason)
    return len(hit)
