"""The dashboard's table of runs: filters and keyset paging done in SQL, so a page costs the same at 100 000
runs as at 10."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .db import ON_HOST, Store, status_words
from .encoding import decoded
from .record import STOPPED_REASONS, Status

# What a row shows; the spec, parser state and events stay out of the table's query.
COLUMNS = ("id", "playbook", "host", "status", "phase", "stalled", "progress", "reason", "exit_code",
           "created_at", "started_at", "ended_at", "heartbeat", "progress_at", "predicted_at", "sweep_id",
           "point", "last_line", "node", "queue_reason", "invalid")
# Where a text search looks (and a number is a run id too).
SEARCHED = ("playbook", "host", "reason", "spec", "point", "last_line")


@dataclass
class RunFilters:
    """Each filter given narrows the runs (ANDed); `text` is a substring of any searched column."""

    statuses: list[str] = field(default_factory=list)
    host: str | None = None
    playbook: str | None = None
    sweep: int | None = None
    text: str | None = None

    def where(self) -> tuple[str, list[Any]]:
        # runs only: a multi-node run's other nodes are records of their own, shown on its page
        clauses: list[str] = ["parent_id IS NULL"]
        args: list[Any] = []
        if self.statuses:  # status words as shown: `stopped` apart from `cancelled`
            clause, more = status_words(self.statuses)
            clauses.append(clause)
            args += more
        if self.host is not None:
            clauses.append(ON_HOST)
            args += [self.host, self.host]
        for column, value in (("playbook", self.playbook), ("sweep_id", self.sweep)):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        if self.text:
            pattern = "%" + self.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            text = " OR ".join(f"{f} LIKE ? ESCAPE '\\'" for f in SEARCHED)
            if self.text.isdigit() and len(self.text) < 19:
                text += " OR id = ?"
                args += [pattern] * len(SEARCHED) + [int(self.text)]
            else:
                args += [pattern] * len(SEARCHED)
            clauses.append(f"({text})")
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


def _and(where: str) -> str:
    return "AND" if where else "WHERE"


def rows(store: Store, filters: RunFilters, limit: int, *, before: int | None = None,
         after: int | None = None) -> list[dict[str, Any]]:
    """Up to `limit` rows matching, with their JSON decoded: the newest older than `before` (or the newest
    of all), newest first; or, with `after` alone, the oldest newer than it, oldest first."""
    where, args = filters.where()
    keyset = ""
    if before is not None:
        keyset, args = f"{_and(where)} id < ?", [*args, before]
    elif after is not None:
        keyset, args = f"{_and(where)} id > ?", [*args, after]
    order = "ASC" if after is not None and before is None else "DESC"
    sql = f"SELECT {', '.join(COLUMNS)} FROM runs{where} {keyset} ORDER BY id {order} LIMIT ?"
    found = [dict(zip(COLUMNS, r)) for r in store.conn.execute(sql, [*args, limit])]
    for r in found:
        r["progress"] = decoded(r["progress"])  # a damaged column shows as empty; `orch status` says which
        r["point"] = decoded(r["point"])
        r["stalled"] = bool(r["stalled"])
        r["shown_status"] = shown_word(r["status"], r["reason"])
    return found


def shown_word(status: str, reason: str | None) -> str:
    """The status word a person reads of a row (shapes.shown_status, without the host's silence)."""
    return "stopped" if status == Status.CANCELLED and (reason or "").startswith(STOPPED_REASONS) else status


def count(store: Store, filters: RunFilters, cap: int) -> int:
    """How many runs match, counted up to `cap` (an exact count of a text search reads every row)."""
    where, args = filters.where()
    return int(store.conn.execute(f"SELECT COUNT(*) FROM (SELECT 1 FROM runs{where} LIMIT ?)",
                                  [*args, cap]).fetchone()[0])


def exists(store: Store, filters: RunFilters, *, older_than: int | None = None,
           newer_than: int | None = None) -> bool:
    """Does a run match that is older (or newer) than this one?"""
    where, args = filters.where()
    op, run_id = ("<", older_than) if older_than is not None else (">", newer_than)
    clause = f"{_and(where)} id {op} ?"
    return store.conn.execute(f"SELECT 1 FROM runs{where} {clause} LIMIT 1", [*args, run_id]).fetchone() is not None


def hosts(store: Store) -> list[str]:
    """Every host a run was recorded on, sorted."""
    return [h for (h,) in store.conn.execute("SELECT DISTINCT host FROM runs ORDER BY host")]


def playbooks(store: Store) -> list[str]:
    """Every playbook a run was recorded of, sorted."""
    return [p for (p,) in store.conn.execute("SELECT DISTINCT playbook FROM runs ORDER BY playbook")]
