"""A sweep's tables: the sweep, its points and its events, and the runs each point made.

Rows come back as dicts with their JSON columns decoded (`doc`, `notify`, a point's `gpus` and `diff`,
an event's `data`); statuses stay the stored words, for the sweep package to type and to check its
transitions against. Writes join the caller's transaction (`Store.tx`) when there is one.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from typing import Any

from .db import Store
from .encoding import decoded, dump_json, real_out
from .record import ACTIVE


def _dicts(cur: sqlite3.Cursor) -> list[dict[str, Any]]:
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _sweep(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "doc": decoded(row["doc"]), "notify": decoded(row["notify"]) or []}


def _point(row: dict[str, Any]) -> dict[str, Any]:
    # `point` stays the text runs.point holds (a point's runs are found by it); `diff` is it decoded
    return {**row, "gpus": decoded(row["gpus"]), "diff": decoded(row["point"]) or {}}


# sweeps ----------------------------------------------------------------------------------------------
def sweep(store: Store, sweep_id: int) -> dict[str, Any] | None:
    """The sweep's row, or None (none such; or a database from before sweeps were recorded)."""
    try:
        rows = _dicts(store.conn.execute("SELECT * FROM sweeps WHERE id = ?", (sweep_id,)))
    except sqlite3.OperationalError as exc:
        if "no such table" not in str(exc):
            raise
        return None
    return _sweep(rows[0]) if rows else None


def find(store: Store, name: str, file_hash: str, instance: str) -> int | None:
    """The id of the sweep of this name, file content and instance."""
    row = store.conn.execute("SELECT id FROM sweeps WHERE name = ? AND file_hash = ? AND instance = ?",
                             (name, file_hash, instance)).fetchone()
    return None if row is None else int(row[0])


def newest(store: Store, name: str | None = None, file_hash: str | None = None) -> int | None:
    """The newest sweep's id (of this name; of this file content too), or None."""
    clauses = [c for c, v in (("name = ?", name), ("file_hash = ?", file_hash)) if v is not None]
    where = " WHERE " + " AND ".join(clauses) if clauses else ""
    row = store.conn.execute(f"SELECT MAX(id) FROM sweeps{where}", [v for v in (name, file_hash) if v is not None])
    value = row.fetchone()[0]
    return None if value is None else int(value)


def ids(store: Store, limit: int) -> list[int]:
    """The newest sweeps' ids, newest first."""
    return [int(i) for (i,) in store.conn.execute("SELECT id FROM sweeps ORDER BY id DESC LIMIT ?", (limit,))]


def of_name(store: Store, name: str, limit: int) -> list[dict[str, Any]]:
    """The newest sweeps of this name (id, instance, created_at), newest first."""
    return _dicts(store.conn.execute(
        "SELECT id, instance, created_at FROM sweeps WHERE name = ? ORDER BY id DESC LIMIT ?", (name, limit)))


def of_file(store: Store, name: str, file_hash: str) -> list[int]:
    """Every sweep of this file (name and content), in the order they were created."""
    return [int(i) for (i,) in store.conn.execute(
        "SELECT id FROM sweeps WHERE name = ? AND file_hash = ? ORDER BY created_at, id", (name, file_hash))]


def recent(store: Store, limit: int) -> list[dict[str, Any]]:
    """The newest sweeps (id, name, instance), newest first: the dashboard's filter choices."""
    return _dicts(store.conn.execute("SELECT id, name, instance FROM sweeps ORDER BY id DESC LIMIT ?", (limit,)))


def create(store: Store, *, name: str, file_hash: str, instance: str, path: str, playbook: str,
           doc: dict[str, Any], notify: list[str], status: str, points: Iterable[dict[str, Any]]) -> int:
    """A new sweep with its points (index, point, host, gpus, status each); its id. `doc` is the sweep
    file as it was parsed."""
    with store.tx() as c:
        cur = c.execute(
            "INSERT INTO sweeps (name, file_hash, instance, path, playbook, doc, notify, status, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (name, file_hash, instance, path, playbook, dump_json(doc), dump_json(notify), status, time.time()),
        )
        sweep_id = int(cur.lastrowid or 0)
        c.executemany(
            "INSERT INTO sweep_points (sweep_id, idx, point, host, gpus, status, attempts) VALUES (?, ?, ?, ?, ?, ?, 0)",
            [(sweep_id, p["index"], p["point"], p["host"], dump_json(p["gpus"]), p["status"]) for p in points],
        )
    return sweep_id


_SWEEP_FIELDS = frozenset({"status", "controller", "heartbeat", "ended_at"})


def update(store: Store, sweep_id: int, **fields: Any) -> None:
    """Set these of the sweep's columns (status, controller, heartbeat, ended_at)."""
    unknown = set(fields) - _SWEEP_FIELDS
    if unknown:
        raise ValueError(f"not a sweep column to set: {', '.join(sorted(unknown))}")
    with store.tx() as c:
        c.execute(f"UPDATE sweeps SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?",
                  [*fields.values(), sweep_id])


# points ----------------------------------------------------------------------------------------------
def points(store: Store, sweep_id: int) -> list[dict[str, Any]]:
    cur = store.conn.execute("SELECT * FROM sweep_points WHERE sweep_id = ? ORDER BY idx", (sweep_id,))
    return [_point(r) for r in _dicts(cur)]


def point(store: Store, sweep_id: int, index: int) -> dict[str, Any] | None:
    cur = store.conn.execute("SELECT * FROM sweep_points WHERE sweep_id = ? AND idx = ?", (sweep_id, index))
    rows = _dicts(cur)
    return _point(rows[0]) if rows else None


def statuses(store: Store, sweep_id: int, index: int) -> tuple[str, str]:
    """The sweep's status and the point's, read together."""
    row = store.conn.execute(
        "SELECT s.status, p.status FROM sweeps s JOIN sweep_points p ON p.sweep_id = s.id"
        " WHERE s.id = ? AND p.idx = ?", (sweep_id, index)).fetchone()
    return str(row[0]), str(row[1])


def set_point_status(store: Store, sweep_id: int, index: int, status: str, *, fault: str | None,
                     reason: str | None, run_id: int | None, attempt: bool) -> None:
    """The point's status, fault and reason; its run when one is given; one attempt more when it starts one."""
    with store.tx() as c:
        c.execute("UPDATE sweep_points SET status = ?, fault = ?, reason = ?, run_id = COALESCE(?, run_id),"
                  " attempts = attempts + ? WHERE sweep_id = ? AND idx = ?",
                  (status, fault, reason, run_id, int(attempt), sweep_id, index))


def add_point(store: Store, sweep_id: int, point: dict[str, Any]) -> None:
    """One more point (index, point, host, gpus, status): a searching sweep adds each as it proposes it."""
    with store.tx() as c:
        c.execute("INSERT INTO sweep_points (sweep_id, idx, point, host, gpus, status, attempts) VALUES (?, ?, ?, ?, ?, ?, 0)",
                  (sweep_id, point["index"], point["point"], point["host"], dump_json(point["gpus"]), point["status"]))


def set_point_host(store: Store, sweep_id: int, index: int, host: str, gpus: list[int] | None) -> None:
    """Where a point runs now (a searching sweep runs a point left over on whichever host is free)."""
    with store.tx() as c:
        c.execute("UPDATE sweep_points SET host = ?, gpus = ? WHERE sweep_id = ? AND idx = ?",
                  (host, dump_json(gpus), sweep_id, index))


def of_playbook(store: Store, playbook: str, before: int) -> list[dict[str, Any]]:
    """Earlier sweeps of a playbook (rows, doc read), newest first: where a search may start from."""
    cur = store.conn.execute("SELECT * FROM sweeps WHERE playbook = ? AND id < ? ORDER BY id DESC", (playbook, before))
    return [_sweep(r) for r in _dicts(cur)]


def set_point_run(store: Store, sweep_id: int, index: int, run_id: int) -> None:
    with store.tx() as c:
        c.execute("UPDATE sweep_points SET run_id = ? WHERE sweep_id = ? AND idx = ?", (run_id, sweep_id, index))


# events ----------------------------------------------------------------------------------------------
def add_event(store: Store, sweep_id: int | None, kind: str, message: str = "", data: Any = None) -> None:
    with store.tx() as c:
        c.execute("INSERT INTO sweep_events (sweep_id, ts, kind, message, data) VALUES (?, ?, ?, ?, ?)",
                  (sweep_id, time.time(), kind, message, dump_json(data)))


def events(store: Store, sweep_id: int) -> list[dict[str, Any]]:
    rows = store.conn.execute("SELECT ts, kind, message, data FROM sweep_events WHERE sweep_id = ? ORDER BY id",
                              (sweep_id,))
    return [{"ts": ts, "kind": k, "message": m, "data": decoded(d)} for ts, k, m, d in rows]


# the runs of a sweep ---------------------------------------------------------------------------------
def run_ids(store: Store, sweep_id: int) -> list[int]:
    """Every run of the sweep, oldest first."""
    return [int(i) for (i,) in store.conn.execute("SELECT id FROM runs WHERE sweep_id = ? ORDER BY id", (sweep_id,))]


def latest_run_of_point(store: Store, sweep_id: int, key: str) -> int | None:
    """The id of the point's newest run (`key`: the point as runs.point holds it)."""
    row = store.conn.execute("SELECT MAX(id) FROM runs WHERE sweep_id = ? AND point = ?", (sweep_id, key)).fetchone()
    return None if row[0] is None else int(row[0])


def runs_of_point(store: Store, sweep_id: int, key: str) -> int:
    """How many runs the point made."""
    return int(store.conn.execute("SELECT COUNT(*) FROM runs WHERE sweep_id = ? AND point = ?",
                                  (sweep_id, key)).fetchone()[0])


def active_runs(store: Store, sweep_id: int) -> list[int]:
    """The sweep's runs that launched and have not ended."""
    marks = ",".join("?" * len(ACTIVE))
    return [int(r[0]) for r in store.conn.execute(
        f"SELECT id FROM runs WHERE sweep_id = ? AND pid IS NOT NULL AND status IN ({marks})",
        (sweep_id, *[s.value for s in ACTIVE]))]


def latest_values(store: Store, sweep_id: int, metric: str) -> list[float]:
    """The newest value of a metric of each of the sweep's valid runs that recorded it (an invalid run's
    numbers count nowhere)."""
    return [real_out(v) for (v,) in store.conn.execute(
        "SELECT value FROM metrics WHERE id IN (SELECT MAX(m.id) FROM metrics m JOIN runs r ON r.id = m.run_id"
        " WHERE r.sweep_id = ? AND m.name = ? AND r.invalid IS NULL GROUP BY m.run_id)", (sweep_id, metric))]
