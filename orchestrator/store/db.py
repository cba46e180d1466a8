"""The SQLite store: runs, an append-only event log, metric time series, patch records.

WAL and a busy timeout let a cron sweep and a user's `orch` write at the same time; every write that
belongs together happens in one `BEGIN IMMEDIATE` transaction.
"""

from __future__ import annotations

import functools
import json
import math
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DatabaseUnavailable, NotFound, UsageError
from . import migrations
from .record import JSON_FIELDS, Run
from .summaries import summaries

if TYPE_CHECKING:
    from sqlite_utils import Database

def _finite(value: Any) -> Any:
    """Non-finite floats as null: JSON has no infinity, and a number read from a log (a 400-digit
    counter) can overflow to one."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _dump(value: Any) -> str | None:
    """Strict JSON only: SQLite's json functions (and every other reader) refuse `Infinity` or `NaN`."""
    return None if value is None else json.dumps(_finite(value), sort_keys=True, allow_nan=False)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(text: str) -> Any:
    """Strict JSON back; ValueError (JSONDecodeError is one) for anything else."""
    return json.loads(text, parse_constant=_refuse_constant)


BUSY_TIMEOUT_S = 60.0  # how long a write waits for another process's transaction


def _busy(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


def _unavailable(exc: sqlite3.OperationalError) -> bool:
    """Locked, read-only, not openable, full: the database's state, not a bug in a statement."""
    text = str(exc).lower()
    return _busy(exc) or any(w in text for w in ("readonly", "read-only", "unable to open", "disk i/o", "is full"))


def _use_wal(conn: sqlite3.Connection) -> None:
    """Switch a database to WAL once. Two processes creating it at once can meet SQLITE_BUSY here,
    which the busy timeout does not cover, so the switch is retried briefly (a read-only database
    is not: it will not change its mind). A database in WAL already (every open but its first) is left
    as it is, without the retry machinery's import."""
    try:
        if conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
            return
    except sqlite3.OperationalError as exc:
        if not _busy(exc):
            raise
    import tenacity

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(_busy),
        stop=tenacity.stop_after_delay(10),
        wait=tenacity.wait_random_exponential(multiplier=0.01, max=0.5),
        reraise=True,
    )
    for attempt in retrying:
        with attempt:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode = WAL")


class Store:
    def __init__(self, path: Path | str, busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self._data_version: int | None = None  # as `changed` last saw it
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.OperationalError as exc:
            raise self.unavailable(exc) from None
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            _use_wal(conn)
            conn.execute("PRAGMA synchronous = NORMAL")
            self.conn = conn
            self.migrate()
        except sqlite3.DatabaseError as exc:
            conn.close()
            if isinstance(exc, sqlite3.OperationalError):
                raise self.unavailable(exc) from None
            raise UsageError(f"{self.path}: not an orch database ({exc})") from None

    def unavailable(self, exc: sqlite3.OperationalError) -> Exception:
        """The one line for a database that cannot be used now; other errors (a bug) unchanged."""
        if _busy(exc):
            return DatabaseUnavailable(f"{self.path}: the database is locked by another process "
                                       f"(waited {self.busy_timeout_s:g} s); try again")
        if _unavailable(exc):
            return DatabaseUnavailable(f"{self.path}: the database cannot be written ({exc}); "
                                       "check that it and its folder are writable and the disk has room")
        return exc

    @functools.cached_property
    def db(self) -> Database:
        """sqlite-utils over the same connection, for schema work and plain-table helpers."""
        from sqlite_utils import Database

        return Database(self.conn)

    def migrate(self, stop_before: str | None = None) -> None:
        if stop_before is None and not self._pending_migrations():
            return
        with self.tx():
            migrations.apply(self.db, stop_before=stop_before)

    def _pending_migrations(self) -> bool:
        try:
            rows = self.conn.execute(
                "SELECT name FROM _sqlite_migrations WHERE migration_set = ?", (migrations.SET,)
            )
        except sqlite3.OperationalError:  # a new database: not even the bookkeeping table yet
            return True
        return bool(set(migrations.names()) - {name for (name,) in rows})

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction; nested calls join the outer one."""
        if self.conn.in_transaction:
            yield self.conn
            return
        try:
            self.conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise self.unavailable(exc) from None
        try:
            yield self.conn
            self.conn.execute("COMMIT")
        except BaseException as exc:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError):
                raise self.unavailable(exc) from None
            raise

    @contextmanager
    def savepoint(self) -> Iterator[sqlite3.Connection]:
        """Inside a transaction, a part of it that an exception rolls back alone (the rest goes on to its
        commit); outside one, a transaction of its own."""
        if not self.conn.in_transaction:
            with self.tx() as c:
                yield c
            return
        self.conn.execute("SAVEPOINT part")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK TO part")
            self.conn.execute("RELEASE part")
            raise
        self.conn.execute("RELEASE part")

    def changed(self) -> bool:
        """Has another connection committed a change since the last call (True the first time)? SQLite's
        data_version: no table is read, so a process can ask it often."""
        try:
            version = self.conn.execute("PRAGMA data_version").fetchone()[0]
        except sqlite3.OperationalError as exc:
            raise self.unavailable(exc) from None
        changed, self._data_version = version != self._data_version, version
        return changed

    def close(self) -> None:
        self.conn.close()

    # runs -------------------------------------------------------------------------------------
    def create_run(self, playbook: str, host: str, spec: dict[str, Any]) -> int:
        now = time.time()
        with self.tx() as c:
            cur = c.execute(
                "INSERT INTO runs (playbook, host, status, phase, spec, created_at, log_offset)"
                " VALUES (?, ?, 'pending', 'starting', ?, ?, 0)",
                (playbook, host, _dump(spec), now),
            )
            run_id = int(cur.lastrowid or 0)
            self.add_event(run_id, "status", "pending", ts=now)
        return run_id

    def next_run_id(self) -> int:
        """The id the next run will get (ids are never reused: removed runs' ids stay taken)."""
        row = self.conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'runs'").fetchone()
        return int(row[0] if row else 0) + 1

    def get_run(self, run_id: int) -> Run:
        row = self.conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise NotFound(f"no run {run_id}")
        return self._decode(row)

    def _decode(self, row: sqlite3.Row | tuple) -> Run:
        cols = self._run_columns()
        run = dict(zip(cols, row))
        unreadable = []
        for key in JSON_FIELDS:
            if run.get(key) is not None:
                try:
                    run[key] = load_json(run[key])
                except ValueError:
                    # one damaged row must not stop `orch status` for all; acting on it is refused later
                    run[key] = None
                    unreadable.append(key)
        run["unreadable"] = unreadable
        return Run.from_row(run)

    def _run_columns(self) -> list[str]:
        if not hasattr(self, "_cols"):
            self._cols = [r[1] for r in self.conn.execute("PRAGMA table_info(runs)")]
        return self._cols

    def list_runs(self, *, limit: int = 50, statuses: Iterable[str] | None = None, host: str | None = None,
                  playbook: str | None = None, tag: str | None = None, sweep_id: int | None = None,
                  since: float | None = None) -> list[Run]:
        where, args = self._run_filter(statuses, host, playbook, tag, sweep_id, since)
        rows = self.conn.execute(f"SELECT * FROM runs{where} ORDER BY id DESC LIMIT ?", [*args, limit])
        return [self._decode(r) for r in rows]

    def statuses(self, host: str, statuses: Iterable[str]) -> dict[int, str]:
        """{run id: status} of the host's runs in these statuses: a cheap look, asked often."""
        where, args = self._run_filter(statuses, host, None, None, None, None)
        return {int(i): str(s) for i, s in self.conn.execute(f"SELECT id, status FROM runs{where}", args)}

    def count_runs(self, *, statuses: Iterable[str] | None = None, host: str | None = None,
                   playbook: str | None = None, tag: str | None = None, sweep_id: int | None = None,
                   since: float | None = None) -> int:
        where, args = self._run_filter(statuses, host, playbook, tag, sweep_id, since)
        return int(self.conn.execute(f"SELECT COUNT(*) FROM runs{where}", args).fetchone()[0])

    @staticmethod
    def _run_filter(statuses: Iterable[str] | None, host: str | None, playbook: str | None, tag: str | None,
                    sweep_id: int | None, since: float | None) -> tuple[str, list[Any]]:
        """A WHERE clause for the filters given (each one ANDed); `since` is epoch seconds of creation."""
        clauses: list[str] = []
        args: list[Any] = []
        if statuses is not None:
            statuses = list(statuses)
            clauses.append(f"status IN ({','.join('?' * len(statuses))})")
            args += statuses
        for column, value in (("host", host), ("playbook", playbook), ("sweep_id", sweep_id)):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        if since is not None:
            clauses.append("created_at >= ?")
            args.append(since)
        if tag is not None:
            clauses.append("EXISTS (SELECT 1 FROM json_each(runs.tags) WHERE value = ?)")
            args.append(tag)
        return (" WHERE " + " AND ".join(clauses) if clauses else ""), args

    def label_run(self, run_id: int, *, tags: Iterable[str] = (), note: str | None = None) -> Run:
        """Add tags (each once) and a note line to a run; the run as it is then."""
        with self.tx():
            run = self.get_run(run_id)
            fields: dict[str, Any] = {"tags": run.tags + [t for t in dict.fromkeys(tags) if t not in run.tags]}
            if note:
                fields["note"] = f"{run.note}\n{note}" if run.note else note
            self.update_run(run_id, **fields)
            return self.get_run(run_id)

    def update_run(self, run_id: int, **fields: Any) -> None:
        if not fields:
            return
        if "status" in fields:
            raise ValueError("status changes go through lifecycle.transition")
        values = [_dump(v) if k in JSON_FIELDS else v for k, v in fields.items()]
        with self.tx() as c:
            c.execute(
                f"UPDATE runs SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?", [*values, run_id]
            )

    # events and metrics -----------------------------------------------------------------------
    def add_event(
        self, run_id: int, kind: str, message: str = "", data: Any = None, ts: float | None = None
    ) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT INTO events (run_id, ts, kind, message, data) VALUES (?, ?, ?, ?, ?)",
                (run_id, ts or time.time(), kind, message, _dump(data)),
            )

    def events(self, run_id: int) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT ts, kind, message, data FROM events WHERE run_id = ? ORDER BY id", (run_id,)
        )
        return [
            {"ts": ts, "kind": kind, "message": msg, "data": _data(data)}
            for ts, kind, msg, data in rows
        ]

    def last_event(self, run_id: int, kinds: Iterable[str]) -> dict[str, Any] | None:
        """The run's latest event of one of these kinds (kind and ts), or None."""
        kinds = list(kinds)
        row = self.conn.execute(
            f"SELECT kind, ts FROM events WHERE run_id = ? AND kind IN ({','.join('?' * len(kinds))})"
            " ORDER BY id DESC LIMIT 1", (run_id, *kinds)).fetchone()
        return None if row is None else {"kind": row[0], "ts": row[1]}

    def previous_run(self, run: Run) -> Run | None:
        """The run of the same playbook on the same host just before this one."""
        row = self.conn.execute("SELECT * FROM runs WHERE playbook = ? AND host = ? AND id < ? ORDER BY id DESC"
                                " LIMIT 1", (run.playbook, run.host, run.id)).fetchone()
        return None if row is None else self._decode(row)

    def add_metrics(self, run_id: int, samples: Iterable[tuple[Any, ...]], ts: float) -> None:
        """Samples are (name, value, step) or (name, value, step, own ts): `ts` stands in where none is given."""
        with self.tx() as c:
            c.executemany(
                "INSERT INTO metrics (run_id, name, value, ts, step) VALUES (?, ?, ?, ?, ?)",
                [(run_id, s[0], float(s[1]), s[3] if len(s) > 3 and s[3] is not None else ts, s[2])
                 for s in samples],
            )

    def add_eagle3_debug(self, run_id: int, records: Iterable[dict[str, Any]], ts: float) -> None:
        """Rows of the debug patch set's table (records from logparse.eagle3_debug, with their log line)."""
        cols = ("line", "stage", "layer", "call", "part", "parts", "shape", "dtype", "absmean")
        with self.tx() as c:
            c.executemany(f"INSERT INTO eagle3_debug (run_id, ts, {', '.join(cols)}) VALUES (?, ?{', ?' * len(cols)})",
                          [(run_id, ts, *(r.get(k) for k in cols)) for r in records])

    def latest_metrics(self, run_id: int) -> dict[str, float]:
        rows = self.conn.execute(
            "SELECT name, value FROM metrics WHERE id IN"
            " (SELECT MAX(id) FROM metrics WHERE run_id = ? GROUP BY name) ORDER BY name",
            (run_id,),
        )
        return dict(rows.fetchall())

    def metric_summaries(self, run_id: int) -> dict[str, dict[str, Any]]:
        """Per metric of the run: last, and mean and p50 over the steady state (see summaries.py)."""
        rows = self.conn.execute("SELECT name, value FROM metrics WHERE run_id = ? ORDER BY id", (run_id,))
        return summaries(rows.fetchall())

    def metric_series(self, run_id: int, name: str) -> list[tuple[float, float, int | None]]:
        rows = self.conn.execute(
            "SELECT ts, value, step FROM metrics WHERE run_id = ? AND name = ? ORDER BY id", (run_id, name)
        )
        return rows.fetchall()

    # patches ----------------------------------------------------------------------------------
    def record_patches(self, records: Iterable[dict[str, Any]]) -> None:
        now = time.time()
        with self.tx():
            self.db.table("patch_records").insert_all([{"ts": now, **r} for r in records])

    def patch_records(self, host: str) -> list[dict[str, Any]]:
        return list(self.db["patch_records"].rows_where("host = ?", [host], order_by="id"))


def _data(text: str | None) -> Any:
    """An event's data; unreadable data is dropped, since the message says what happened."""
    try:
        return load_json(text) if text else None
    except ValueError:
        return None


def eagle3_debug_table(store: Store, run_id: int) -> list[dict[str, Any]]:
    """The debug patch set's table for a run: per stage, layer and part, the latest call's shape, dtype
    and mean |x|, with how many calls were logged; in the order the stages first appeared."""
    rows = store.conn.execute(
        "SELECT stage, layer, part, parts, call, shape, dtype, absmean FROM eagle3_debug WHERE run_id = ?"
        " ORDER BY id", (run_id,))
    table: dict[tuple[Any, ...], dict[str, Any]] = {}
    for stage, layer, part, parts, call, shape, dtype, absmean in rows:
        key = (stage, layer, part)
        calls = table[key]["calls"] + 1 if key in table else 1
        table[key] = {"stage": stage, "layer": layer, "part": f"{part}/{parts}", "shape": shape, "dtype": dtype,
                      "absmean": absmean, "call": call, "calls": calls}
    return list(table.values())

