"""The runs table: filters and keyset paging done in SQL, so a page costs the same at 100 000 runs as at 10."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Any

from ..store import Store
from ..store.record import Status

PAGE_MAX = 200
COUNT_CAP = 10_000  # past this the table says "10000+": an exact count of a text search reads every row
KEY_METRICS = 3
# What a row shows; the spec, parser state and events stay out of the table's query.
COLUMNS = ("id", "playbook", "host", "status", "phase", "stalled", "progress", "reason", "exit_code",
           "created_at", "started_at", "ended_at", "heartbeat", "progress_at", "predicted_at", "sweep_id",
           "point", "last_line", "node", "queue_reason")


@dataclass
class Filters:
    statuses: list[str] = field(default_factory=list)
    host: str | None = None
    playbook: str | None = None
    sweep: int | None = None
    text: str | None = None

    @classmethod
    def parse(cls, params: Any) -> Filters:
        """From a query string (a Mapping with getlist): unknown statuses and a non-numeric sweep are dropped."""
        known = {s.value for s in Status}
        statuses = [s for raw in params.getlist("status") for s in raw.split(",") if s in known]
        sweep = params.get("sweep") or ""
        return cls(statuses=statuses, host=params.get("host") or None, playbook=params.get("playbook") or None,
                   sweep=int(sweep) if sweep.isdigit() and len(sweep) < 19 else None,
                   text=(params.get("q") or "").strip()[:200] or None)

    def where(self) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        args: list[Any] = []
        if self.statuses:
            clauses.append(f"status IN ({','.join('?' * len(self.statuses))})")
            args += self.statuses
        for column, value in (("host", self.host), ("playbook", self.playbook), ("sweep_id", self.sweep)):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        if self.text:
            pattern = "%" + self.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            fields = ("playbook", "host", "reason", "spec", "point", "last_line")
            text = " OR ".join(f"{f} LIKE ? ESCAPE '\\'" for f in fields)
            if self.text.isdigit() and len(self.text) < 19:
                text += " OR id = ?"
                args += [pattern] * len(fields) + [int(self.text)]
            else:
                args += [pattern] * len(fields)
            clauses.append(f"({text})")
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


def _json(text: str | None) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:  # a damaged column shows as empty; `orch status` says which
        return None


def latest_metrics(conn: sqlite3.Connection, run_ids: list[int]) -> dict[int, dict[str, float]]:
    """The newest value of each metric of each run, in one query over the (run_id, name, id) index."""
    found: dict[int, dict[str, float]] = {i: {} for i in run_ids}
    if not run_ids:
        return found
    marks = ",".join("?" * len(run_ids))
    rows = conn.execute(
        f"SELECT run_id, name, value FROM metrics WHERE id IN (SELECT MAX(id) FROM metrics"
        f" WHERE run_id IN ({marks}) GROUP BY run_id, name) ORDER BY run_id, name", run_ids)
    for run_id, name, value in rows:
        found[run_id][name] = value
    return found


def page(store: Store, filters: Filters, limit: int = 50, before: int | None = None,
         after: int | None = None) -> dict[str, Any]:
    """One page of runs, newest first: those older than `before`, or the page just newer than `after`."""
    limit = max(1, min(limit, PAGE_MAX))
    where, args = filters.where()
    keyset = ""
    if before is not None:
        keyset = ("AND" if where else "WHERE") + " id < ?"
        args_page = [*args, before]
    elif after is not None:
        keyset = ("AND" if where else "WHERE") + " id > ?"
        args_page = [*args, after]
    else:
        args_page = list(args)
    order = "ASC" if after is not None and before is None else "DESC"
    sql = f"SELECT {', '.join(COLUMNS)} FROM runs{where} {keyset} ORDER BY id {order} LIMIT ?"
    rows = [dict(zip(COLUMNS, r)) for r in store.conn.execute(sql, [*args_page, limit + 1])]
    more = len(rows) > limit
    rows = rows[:limit]
    if order == "ASC":
        rows.reverse()
    metrics = latest_metrics(store.conn, [r["id"] for r in rows])
    for r in rows:
        r["progress"] = _json(r["progress"])
        r["point"] = _json(r["point"])
        r["stalled"] = bool(r["stalled"])
        r["metrics"] = dict(list(metrics[r["id"]].items())[:KEY_METRICS])
    count = store.conn.execute(f"SELECT COUNT(*) FROM (SELECT 1 FROM runs{where} LIMIT ?)",
                               [*args, COUNT_CAP + 1]).fetchone()[0]
    newest = rows[0]["id"] if rows else None
    oldest = rows[-1]["id"] if rows else None
    # where the neighbouring pages start (None: there is none); `more` answers for the way this page went
    older = more if order == "DESC" else _exists(store, where, args, "<", oldest)
    newer = more if order == "ASC" else before is not None and _exists(store, where, args, ">", newest)
    return {"runs": rows, "count": min(count, COUNT_CAP), "count_capped": count > COUNT_CAP,
            "older": oldest if older else None, "newer": newest if newer else None}


def _exists(store: Store, where: str, args: list[Any], op: str, run_id: int | None) -> bool:
    if run_id is None:
        return False
    clause = ("AND" if where else "WHERE") + f" id {op} ?"
    return store.conn.execute(f"SELECT 1 FROM runs{where} {clause} LIMIT 1", [*args, run_id]).fetchone() is not None


def facets(store: Store) -> dict[str, Any]:
    """The choices of the filters: statuses, hosts and playbooks seen, the newest sweeps."""
    hosts = [h for (h,) in store.conn.execute("SELECT DISTINCT host FROM runs ORDER BY host")]
    playbooks = [p for (p,) in store.conn.execute("SELECT DISTINCT playbook FROM runs ORDER BY playbook")]
    sweeps = [{"id": i, "name": n, "instance": inst} for i, n, inst in store.conn.execute(
        "SELECT id, name, instance FROM sweeps ORDER BY id DESC LIMIT 200")]
    return {"statuses": [s.value for s in Status], "hosts": hosts, "playbooks": playbooks, "sweeps": sweeps}
