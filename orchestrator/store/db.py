"""The SQLite store: runs, an append-only event log, metric time series, patch records.

WAL and a busy timeout let a cron sweep and a user's `orch` write at the same time; every write that
belongs together happens in one `BEGIN IMMEDIATE` transaction.
"""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import DatabaseUnavailable, NotFound, UsageError
from . import migrations
from .connection import BUSY_TIMEOUT_S, busy, create_owner_only, unusable, use_wal
from .controller import Controller
from .encoding import decoded, dump_json, load_json, real_in, real_out
from .record import ACTIVE, JSON_FIELDS, STOPPED_REASONS, RunRecord, Status
from .summaries import IDLE_ZERO, headline, summaries

if TYPE_CHECKING:
    from sqlite_utils import Database

    from .runtables import RunTables

# What a statement can raise past the store's own errors (a damaged file, a failed constraint): callers
# that must carry on whatever the database did catch this rather than sqlite3's class by name.
StoreError = sqlite3.Error

# The runs on a host (twice the host's name): a run across several hosts is on each of its nodes' hosts.
ON_HOST = "(host = ? OR id IN (SELECT parent_id FROM runs WHERE host = ?))"
# A run ended on purpose: `cancelled` to the lifecycle, `stopped` to a person (record.STOPPED_REASONS).
_STOPPED = "(status = 'cancelled' AND (" + " OR ".join(
    f"substr(COALESCE(reason, ''), 1, {len(r)}) = '{r}'" for r in STOPPED_REASONS) + "))"


def status_words(words: Iterable[str]) -> tuple[str, list[Any]]:
    """A WHERE clause for the runs shown in any of these status words: the lifecycle's statuses, but
    `stopped` for a run ended on purpose and `cancelled` only for the others (shapes.shown_status)."""
    clauses, args = [], []
    for word in dict.fromkeys(words):
        if word == "stopped":
            clauses.append(_STOPPED)
        elif word == Status.CANCELLED:
            clauses.append(f"(status = 'cancelled' AND NOT {_STOPPED})")
        else:
            clauses.append("status = ?")
            args.append(word)
    return "(" + (" OR ".join(clauses) or "0") + ")", args


class Store:
    def __init__(self, path: Path | str, busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.path = Path(path)
        self.busy_timeout_s = busy_timeout_s
        self._data_version: int | None = None  # as `changed` last saw it
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            create_owner_only(self.path)
        try:
            conn = sqlite3.connect(str(self.path), timeout=busy_timeout_s, isolation_level=None,
                                   check_same_thread=False)
        except sqlite3.OperationalError as exc:
            raise self.unavailable(exc) from None
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
            use_wal(conn)
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
        if busy(exc):
            return DatabaseUnavailable(f"{self.path}: the database is locked by another process "
                                       f"(waited {self.busy_timeout_s:g} s); try again")
        if unusable(exc):
            return DatabaseUnavailable(f"{self.path}: the database cannot be written ({exc}); "
                                       "check that it and its folder are writable and the disk has room")
        return exc

    @functools.cached_property
    def db(self) -> Database:
        """sqlite-utils over the same connection, for schema work and plain-table helpers."""
        from sqlite_utils import Database

        return Database(self.conn)

    def migrate(self, stop_before: str | None = None) -> None:
        if stop_before is None and not migrations.pending(self.conn):
            return
        with self.tx():
            migrations.MIGRATIONS.apply(self.db, stop_before=stop_before)

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

    def read_only(self) -> None:
        """From now on this connection refuses every write (a reader that must never change anything)."""
        self.conn.execute("PRAGMA query_only = 1")

    def close(self) -> None:
        self.conn.close()

    def scratch_copy(self) -> Store:
        """This database copied into memory: what is written to the copy (a dry run's run, its lease and
        events) goes nowhere, while everything already recorded reads as here."""
        copy = Store(":memory:")
        self.conn.backup(copy.conn)
        return copy

    # runs -------------------------------------------------------------------------------------
    def create_run(self, playbook: str, host: str, spec: dict[str, Any]) -> int:
        now = time.time()
        with self.tx() as c:
            cur = c.execute(
                "INSERT INTO runs (playbook, host, status, phase, spec, created_at, log_offset)"
                " VALUES (?, ?, 'pending', 'starting', ?, ?, 0)",
                (playbook, host, dump_json(spec), now),
            )
            run_id = int(cur.lastrowid or 0)
            self.add_event(run_id, "status", "pending", ts=now)
        return run_id

    def next_run_id(self) -> int:
        """The id the next run will get (ids are never reused: removed runs' ids stay taken)."""
        row = self.conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'runs'").fetchone()
        return int(row[0] if row else 0) + 1

    def newest_run_id(self) -> int:
        """The highest id of a run on record (0: none), as a mark to tell the runs created after it."""
        return int(self.conn.execute("SELECT COALESCE(MAX(id), 0) FROM runs").fetchone()[0])

    def created_at(self, run_id: int) -> float | None:
        """When the run was created (None: no such run); one column, without decoding the row."""
        row = self.conn.execute("SELECT created_at FROM runs WHERE id = ?", (run_id,)).fetchone()
        return None if row is None else row[0]  # as stored: run tokens on hosts hold its text

    def log_position(self, run_id: int) -> tuple[int, Status]:
        """How far the run's log is recorded (log_offset) and its status: what a watcher checks before it
        writes what it read past that offset."""
        offset, status = self.conn.execute("SELECT log_offset, status FROM runs WHERE id = ?", (run_id,)).fetchone()
        return offset, Status(status)

    def get_run(self, run_id: int) -> RunRecord:
        row = self.conn.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise NotFound(f"no run {run_id}")
        return self._decode(row)

    def _decode(self, row: sqlite3.Row | tuple) -> RunRecord:
        cols = self.run_columns()
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
        return RunRecord.from_row(run)

    def run_columns(self) -> list[str]:
        if not hasattr(self, "_cols"):
            self._cols = [r[1] for r in self.conn.execute("PRAGMA table_info(runs)")]
        return self._cols

    def list_runs(self, *, limit: int = 50, statuses: Iterable[str] | None = None, host: str | None = None,
                  playbook: str | None = None, tag: str | None = None, sweep_id: int | None = None,
                  since: float | None = None, words: Iterable[str] | None = None) -> list[RunRecord]:
        """The newest runs matching the filters; `words` are status words as shown (see status_words)."""
        where, args = self._run_filter(statuses, host, playbook, tag, sweep_id, since, runs_only=True, words=words)
        rows = self.conn.execute(f"SELECT * FROM runs{where} ORDER BY id DESC LIMIT ?", [*args, limit])
        return [self._decode(r) for r in rows]

    def statuses(self, host: str, statuses: Iterable[str]) -> dict[int, str]:
        """{run id: status} of the host's runs in these statuses: a cheap look, asked often."""
        where, args = self._run_filter(statuses, host, None, None, None, None)
        return {int(i): str(s) for i, s in self.conn.execute(f"SELECT id, status FROM runs{where}", args)}

    def count_runs(self, *, statuses: Iterable[str] | None = None, host: str | None = None,
                   playbook: str | None = None, tag: str | None = None, sweep_id: int | None = None,
                   since: float | None = None, after_id: int | None = None, watcher: str | None = None,
                   words: Iterable[str] | None = None) -> int:
        where, args = self._run_filter(statuses, host, playbook, tag, sweep_id, since, after_id=after_id,
                                       watcher=watcher, runs_only=True, words=words)
        return int(self.conn.execute(f"SELECT COUNT(*) FROM runs{where}", args).fetchone()[0])

    @staticmethod
    def _run_filter(statuses: Iterable[str] | None, host: str | None, playbook: str | None, tag: str | None,
                    sweep_id: int | None, since: float | None, *, after_id: int | None = None,
                    watcher: str | None = None, runs_only: bool = False,
                    words: Iterable[str] | None = None) -> tuple[str, list[Any]]:
        """A WHERE clause for the filters given (each one ANDed); `since` is epoch seconds of creation,
        `after_id` keeps the runs created after that one; `runs_only` leaves out the other nodes of
        multi-node runs (each is a record of its own, listed under its run)."""
        clauses: list[str] = ["parent_id IS NULL"] if runs_only else []
        args: list[Any] = []
        if statuses is not None:
            statuses = list(statuses)
            clauses.append(f"status IN ({','.join('?' * len(statuses))})")
            args += statuses
        if words is not None:
            clause, more = status_words(words)
            clauses.append(clause)
            args += more
        if after_id is not None:
            clauses.append("id > ?")
            args.append(after_id)
        if host is not None and runs_only:
            clauses.append(ON_HOST)
            args += [host, host]
            host = None
        for column, value in (("host", host), ("playbook", playbook), ("sweep_id", sweep_id), ("watcher", watcher)):
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

    def ended_before(self, cutoff: float) -> list[RunRecord]:
        """Ended runs, not part of a sweep, that ended (or, never started, were created) before `cutoff`
        (epoch seconds), oldest first."""
        active = [s.value for s in ACTIVE]
        rows = self.conn.execute(
            "SELECT id FROM runs WHERE sweep_id IS NULL AND parent_id IS NULL AND COALESCE(ended_at, created_at) < ?"
            f" AND status NOT IN ({','.join('?' * len(active))}) ORDER BY id", [cutoff, *active]).fetchall()
        return [self.get_run(run_id) for (run_id,) in rows]

    def delete_run(self, run_id: int) -> None:
        """The run's record goes, with its events, metrics and lease, and so do its other nodes'; its id stays
        taken (AUTOINCREMENT)."""
        with self.tx() as c:
            ids = [run_id, *(i for (i,) in c.execute("SELECT id FROM runs WHERE parent_id = ?", (run_id,)))]
            for one in ids:
                for table in ("events", "metrics", "leases"):
                    c.execute(f"DELETE FROM {table} WHERE run_id = ?", (one,))
                c.execute("DELETE FROM runs WHERE id = ?", (one,))

    def nodes_of(self, run_id: int) -> list[RunRecord]:
        """A multi-node run's nodes in rank order, its head (the run itself) first; [] for a one-host run.
        Asked of any node, the answer is its run's."""
        run = self.get_run(run_id)
        head = run.parent_id or run.id
        rows = self.conn.execute("SELECT * FROM runs WHERE id = ? OR parent_id = ? ORDER BY node_rank, id",
                                 (head, head)).fetchall()
        return [self._decode(r) for r in rows] if len(rows) > 1 or run.node_rank is not None else []

    def claim_end_step(self, run_id: int, step: str) -> str | None:
        """Record in the run's end_steps that the step runs now, by this process: "claimed", or "taken over"
        when its claimer died before it was over; None when it already ran (or runs elsewhere)."""
        me = Controller.me()
        with self.tx() as c:
            steps, claims = c.execute("SELECT end_steps, end_claims FROM runs WHERE id = ?", (run_id,)).fetchone()
            done = load_json(steps) if steps else []
            under_way = _claims(claims)
            if step in done and not (step in under_way and not claim_alive(under_way[step])):
                return None
            under_way[step] = {"by": str(me), "at": time.time()}
            self.update_run(run_id, end_steps=done if step in done else [*done, step], end_claims=under_way)
        return "taken over" if step in done else "claimed"

    def end_step_over(self, run_id: int, step: str) -> None:
        """The step's claimer is done with it (it ran, or failed for good)."""
        with self.tx() as c:
            (claims,) = c.execute("SELECT end_claims FROM runs WHERE id = ?", (run_id,)).fetchone()
            under_way = _claims(claims)
            if under_way.pop(step, None) is not None:
                self.update_run(run_id, end_claims=under_way)

    def unclaim_end_step(self, run_id: int, step: str) -> None:
        """The step's claimer could not do it (its host did not answer): it is to be done again, by anyone."""
        with self.tx() as c:
            steps, claims = c.execute("SELECT end_steps, end_claims FROM runs WHERE id = ?", (run_id,)).fetchone()
            under_way = _claims(claims)
            under_way.pop(step, None)
            self.update_run(run_id, end_steps=[s for s in (load_json(steps) if steps else []) if s != step],
                            end_claims=under_way)

    def abandoned_ends(self, host: str | None = None) -> list[RunRecord]:
        """Ended runs with an end step whose claimer died before it was over (oldest first)."""
        sql = "SELECT * FROM runs WHERE end_claims IS NOT NULL AND end_claims NOT IN ('', '{}')"
        rows = self.conn.execute(sql + (" AND host = ?" if host else "") + " ORDER BY id",
                                 (host,) if host else ()).fetchall()
        return [run for run in map(self._decode, rows)
                if run.status.terminal and any(not claim_alive(c) for c in run.end_claims.values())]

    def run_counts(self) -> dict[str, dict[str, int]]:
        """Per host, how many runs it has in each status."""
        counts: dict[str, dict[str, int]] = {}
        for host, status, n in self.conn.execute("SELECT host, status, COUNT(*) FROM runs GROUP BY host, status"):
            counts.setdefault(host, {})[status] = n
        return counts

    def label_run(self, run_id: int, *, tags: Iterable[str] = (), note: str | None = None) -> RunRecord:
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
        values = [dump_json(v) if k in JSON_FIELDS else v for k, v in fields.items()]
        with self.tx() as c:
            c.execute(
                f"UPDATE runs SET {', '.join(f'{k} = ?' for k in fields)} WHERE id = ?", [*values, run_id]
            )

    def complete_receipt(self, run_id: int, parts: dict[str, Any]) -> None:
        """Add parts to the run's receipt (store/receipts.py), each top-level key replaced whole."""
        with self.tx() as c:
            row = c.execute("SELECT receipt FROM runs WHERE id = ?", (run_id,)).fetchone()
            try:
                old = load_json(row[0]) if row and row[0] else {}
            except ValueError:
                old = {}  # a damaged receipt is replaced rather than kept unreadable
            c.execute("UPDATE runs SET receipt = ? WHERE id = ?", (dump_json({**(old or {}), **parts}), run_id))

    def mark_invalid(self, run_id: int, reason: str) -> None:
        """Its numbers do not count (the first reason given stays: it is what made them invalid)."""
        with self.tx() as c:
            c.execute("UPDATE runs SET invalid = COALESCE(invalid, ?) WHERE id = ?", (reason, run_id))

    def beat(self, run_ids: Iterable[int], watcher: str, at: float) -> None:
        """Set the heartbeat of those of these runs still active that `watcher` is recorded as watching, in
        one write: their host was heard from at `at`, though their record had nothing new."""
        ids = list(run_ids)
        if not ids:
            return
        active = [s.value for s in ACTIVE]
        with self.tx() as c:
            c.execute(
                f"UPDATE runs SET heartbeat = ? WHERE watcher = ? AND id IN ({', '.join('?' * len(ids))})"
                f" AND status IN ({', '.join('?' * len(active))})", [at, watcher, *ids, *active])

    # events and metrics -----------------------------------------------------------------------
    def add_event(
        self, run_id: int, kind: str, message: str = "", data: Any = None, ts: float | None = None
    ) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT INTO events (run_id, ts, kind, message, data) VALUES (?, ?, ?, ?, ?)",
                (run_id, ts or time.time(), kind, message, dump_json(data)),
            )

    def events(self, run_id: int) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT ts, kind, message, data FROM events WHERE run_id = ? ORDER BY id", (run_id,)
        )
        return [
            {"ts": ts, "kind": kind, "message": msg, "data": decoded(data)}
            for ts, kind, msg, data in rows
        ]

    def last_event(self, run_id: int, kinds: Iterable[str]) -> dict[str, Any] | None:
        """The run's latest event of one of these kinds (kind and ts), or None."""
        kinds = list(kinds)
        row = self.conn.execute(
            f"SELECT kind, ts FROM events WHERE run_id = ? AND kind IN ({','.join('?' * len(kinds))})"
            " ORDER BY id DESC LIMIT 1", (run_id, *kinds)).fetchone()
        return None if row is None else {"kind": row[0], "ts": row[1]}

    def previous_run(self, run: RunRecord) -> RunRecord | None:
        """The run of the same playbook on the same host just before this one."""
        row = self.conn.execute("SELECT * FROM runs WHERE playbook = ? AND host = ? AND id < ? ORDER BY id DESC"
                                " LIMIT 1", (run.playbook, run.host, run.id)).fetchone()
        return None if row is None else self._decode(row)

    def add_metrics(self, run_id: int, samples: Iterable[tuple[Any, ...]], ts: float) -> None:
        """Samples are (name, value, step) or (name, value, step, own ts): `ts` stands in where none is given."""
        with self.tx() as c:
            c.executemany(
                "INSERT INTO metrics (run_id, name, value, ts, step) VALUES (?, ?, ?, ?, ?)",
                [(run_id, s[0], real_in(float(s[1])), s[3] if len(s) > 3 and s[3] is not None else ts, s[2])
                 for s in samples],  # a NaN kept as one (encoding.real_in)
            )

    def latest_metrics(self, run_id: int) -> dict[str, float]:
        rows = self.conn.execute(
            "SELECT name, value FROM metrics WHERE id IN"
            " (SELECT MAX(id) FROM metrics WHERE run_id = ? GROUP BY name) ORDER BY name",
            (run_id,),
        )
        return {name: real_out(value) for name, value in rows}

    def headline_metrics(self, run_id: int) -> dict[str, float]:
        """The run's metrics as its headline shows them: the latest of each, a serving rate's steady state at
        work rather than the idle zero an engine prints after every burst (summaries.headline)."""
        found = self.latest_metrics(run_id)
        for name in IDLE_ZERO & found.keys():
            found[name] = headline(name, [v for _, v, _ in self.metric_series(run_id, name)])
        return found

    def metric_summaries(self, run_id: int) -> dict[str, dict[str, Any]]:
        """Per metric of the run: last, and mean and p50 over the steady state (see summaries.py)."""
        rows = self.conn.execute("SELECT name, value FROM metrics WHERE run_id = ? ORDER BY id", (run_id,))
        return summaries((name, real_out(value)) for name, value in rows)

    def metric_values(self, run_id: int) -> dict[str, list[float]]:
        """Every sample of each of the run's metrics, in recorded order (a benchmark's: one per repeat)."""
        found: dict[str, list[float]] = {}
        for name, value in self.conn.execute("SELECT name, value FROM metrics WHERE run_id = ? ORDER BY id",
                                             (run_id,)):
            found.setdefault(name, []).append(value)
        return found

    def latest_metrics_of(self, run_ids: list[int]) -> dict[int, dict[str, float]]:
        """The newest value of each metric of each run, in one query over the (run_id, name, id) index."""
        found: dict[int, dict[str, float]] = {i: {} for i in run_ids}
        if not run_ids:
            return found
        marks = ",".join("?" * len(run_ids))
        rows = self.conn.execute(
            f"SELECT run_id, name, value FROM metrics WHERE id IN (SELECT MAX(id) FROM metrics"
            f" WHERE run_id IN ({marks}) GROUP BY run_id, name) ORDER BY run_id, name", run_ids)
        for run_id, name, value in rows:
            found[run_id][name] = real_out(value)
        return found

    def count_samples(self, run_id: int, name: str) -> int:
        """How many samples of a metric the run recorded."""
        row = self.conn.execute("SELECT COUNT(*) FROM metrics WHERE run_id = ? AND name = ?", (run_id, name))
        return int(row.fetchone()[0])

    def recent_samples(self, run_id: int, limit: int) -> list[tuple[str, float, float]]:
        """The run's newest `limit` samples of all its metrics, (name, ts, value) in recorded order."""
        rows = self.conn.execute(
            "SELECT name, ts, value FROM (SELECT id, name, ts, value FROM metrics WHERE run_id = ?"
            " ORDER BY id DESC LIMIT ?) ORDER BY id", (run_id, limit))
        return [(name, ts, real_out(value)) for name, ts, value in rows]

    def metric_series(self, run_id: int, name: str) -> list[tuple[float, float, int | None]]:
        rows = self.conn.execute(
            "SELECT ts, value, step FROM metrics WHERE run_id = ? AND name = ? ORDER BY id", (run_id, name)
        )
        return [(ts, real_out(value), step) for ts, value, step in rows]

    # plugins' tables --------------------------------------------------------------------------
    def has_tables_of(self, tables: RunTables) -> bool:
        """Are a plugin's migrations all applied in this database?"""
        try:
            done = {name for (name,) in self.conn.execute(
                "SELECT name FROM _sqlite_migrations WHERE migration_set = ?", (tables.migration_set,))}
        except sqlite3.OperationalError:
            done = set()
        return {name for name, _ in tables.migrations} <= done

    @property
    def writable(self) -> bool:
        return not self.conn.execute("PRAGMA query_only").fetchone()[0]

    def use(self, tables: RunTables) -> None:
        """Make a plugin's tables as its own migrations say, those not applied yet in this database."""
        if self.has_tables_of(tables):
            return
        with self.tx():
            migrations.apply_set(self.db, tables.migration_set, tables.migrations)

    def real_columns(self, tables: RunTables) -> frozenset[str]:
        """The columns of a plugin's tables that hold numbers with a fraction (REAL, FLOAT): where a NaN may
        be stored as text (encoding.real_in)."""
        found = set()
        for reader in tables.readers:
            for column in self.db.table(reader.table).columns:
                if column.type.upper() in ("REAL", "FLOAT", "DOUBLE"):
                    found.add(column.name)
        return frozenset(found)

    def add_rows(self, run_id: int, rows: Iterable[tuple[str, dict[str, Any]]], ts: float,
                 tables: Iterable[RunTables]) -> None:
        """Rows that plugins' line readers read from a run's log, as (table, row), into those plugins' tables."""
        owners = {reader.table: t for t in tables for reader in t.readers}
        by_table: dict[str, list[dict[str, Any]]] = {}
        for table, row in rows:  # a NaN read from a log is kept as one (encoding.real_in)
            by_table.setdefault(table, []).append({**{k: real_in(v) for k, v in row.items()}, "run_id": run_id,
                                                   "ts": ts})
        with self.tx():
            for table, found in by_table.items():
                self.use(owners[table])
                self.db.table(table).insert_all(found)

    # patches ----------------------------------------------------------------------------------
    def record_patches(self, records: Iterable[dict[str, Any]]) -> None:
        now = time.time()
        with self.tx():
            self.db.table("patch_records").insert_all([{"ts": now, **r} for r in records])

    def patch_records(self, host: str) -> list[dict[str, Any]]:
        return list(self.db["patch_records"].rows_where("host = ?", [host], order_by="id"))

    def patch_records_of_run(self, run_id: int) -> list[dict[str, Any]]:
        return list(self.db["patch_records"].rows_where("run_id = ?", [run_id], order_by="id"))



# A claimer on another machine (a shared database) is taken for dead this long after its claim: no end step
# takes so long (the log's last read waits a minute at most, a notification a few seconds).
CLAIM_STALE_S = 900.0


def _claims(text: str | None) -> dict[str, Any]:
    try:
        found = load_json(text) if text else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def claim_alive(claim: Any) -> bool:
    """Whether whoever claimed an end step still lives: on this machine the kernel says (pid and start
    time), elsewhere the claim's age. A claim that cannot be read is nobody's."""
    if not isinstance(claim, dict):
        return False
    who = Controller.parse(claim.get("by"))
    at = claim.get("at")
    if who is None or not isinstance(at, (int, float)):
        return False
    return who.alive(float(at), CLAIM_STALE_S)
