"""Named schema migrations, applied in order on every open (never edit one that has shipped): one set,
`MIGRATIONS`, applied through sqlite-utils' `Migrations`, which records each applied name in
`_sqlite_migrations`.

An up-to-date database opens without sqlite-utils: its package imports all of it (numpy too, where
installed), a quarter of a second that `orch status` would pay on every start. So the set is held here,
`pending` reads the applied names with one query, and sqlite-utils is imported only to apply a migration.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlite_utils import Database
    from sqlite_utils.migrations import Migrations

Step = Callable[["Database"], None]


class MigrationSet:
    """Migrations by name, in the order they were declared (`@MIGRATIONS(name=...)` on a function); applied
    as one sqlite-utils `Migrations` set of the same name."""

    migrations_table = "_sqlite_migrations"  # sqlite-utils' bookkeeping table (tests/test_store.py holds it so)

    def __init__(self, name: str, steps: Iterable[tuple[str, Step]] = ()):
        self.name = name
        self.steps: list[tuple[str, Step]] = list(steps)

    def __call__(self, *, name: str) -> Callable[[Step], Step]:
        def register(fn: Step) -> Step:
            if name in self.names():
                raise ValueError(f"migration {name!r} is already in set {self.name!r}")
            self.steps.append((name, fn))
            return fn

        return register

    def names(self) -> list[str]:
        return [name for name, _ in self.steps]

    def migrations(self) -> Migrations:
        """The set as sqlite-utils applies it."""
        from sqlite_utils.migrations import Migrations

        made = Migrations(self.name)
        for name, fn in self.steps:
            made(name=name)(fn)
        return made

    def apply(self, db: Database, stop_before: str | None = None) -> None:
        self.migrations().apply(db, stop_before=stop_before)

    def pending(self, db: Database) -> list[Any]:
        """sqlite-utils' own answer (each with a `name`): what `pending` below reads without it."""
        return self.migrations().pending(db)


MIGRATIONS = MigrationSet("orch")


def names() -> list[str]:
    """Every migration of the set, in order."""
    return MIGRATIONS.names()


def pending(conn: sqlite3.Connection) -> list[str]:
    """The set's migrations not applied to this database yet: what `MIGRATIONS.pending` says, read with one
    query rather than through sqlite-utils."""
    try:
        rows = conn.execute(f"SELECT name FROM [{MIGRATIONS.migrations_table}] WHERE migration_set = ?",
                            (MIGRATIONS.name,)).fetchall()
    except sqlite3.OperationalError:
        # a new database (not even the bookkeeping table yet), or one not readable just now: applying reads
        # the table again, under the write lock
        rows = []
    applied = {name for (name,) in rows}
    return [name for name in names() if name not in applied]


def apply_set(db: Database, name: str, registered: Iterable[tuple[str, Step]]) -> None:
    """Apply a plugin's migration set (see store/runtables.py): orch's own way, under the set's name."""
    MigrationSet(name, registered).apply(db)


@MIGRATIONS(name="m001_runs_events_metrics")
def m001(db: Database) -> None:
    db["runs"].create(
        {
            "id": int,
            "playbook": str,
            "host": str,
            "status": str,
            "phase": str,
            "spec": str,  # JSON
            "created_at": float,
            "started_at": float,
            "ended_at": float,
            "exit_code": int,
            "pid": int,
            "pid_start": str,  # the process start time, so a reused pid is never taken for the job
            "remote_dir": str,
            "log_offset": int,
            "parser_state": str,  # JSON of the log parser, so a watch resumes where it stopped
            "progress": str,  # JSON
            "error": str,  # JSON
            "reason": str,
        },
        pk="id",
        defaults={"log_offset": 0, "phase": "starting"},
        not_null={"playbook", "host", "status", "created_at"},
    )
    db["events"].create(
        {"id": int, "run_id": int, "ts": float, "kind": str, "message": str, "data": str},
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
        not_null={"run_id", "ts", "kind"},
    )
    db["metrics"].create(
        {"id": int, "run_id": int, "name": str, "value": float, "ts": float, "step": int},
        pk="id",
        foreign_keys=[("run_id", "runs", "id")],
        not_null={"run_id", "name", "value", "ts"},
    )
    db["events"].create_index(["run_id", "id"])
    db["metrics"].create_index(["run_id", "name", "id"])


@MIGRATIONS(name="m002_run_watch_fields")
def m002(db: Database) -> None:
    db["runs"].add_column("stalled", int, not_null_default=0)
    db["runs"].add_column("watcher", str)  # "hostname:pid" of the controller watching the run
    db["runs"].add_column("heartbeat", float)
    db["runs"].create_index(["status"])


@MIGRATIONS(name="m003_patch_records")
def m003(db: Database) -> None:
    db["patch_records"].create(
        {
            "id": int,
            "run_id": int,
            "ts": float,
            "host": str,
            "action": str,  # apply | revert
            "patch_set": str,
            "set_hash": str,
            "package": str,
            "version": str,
            "file": str,
            "path": str,
            "sha_before": str,
            "sha_after": str,
        },
        pk="id",
        not_null={"ts", "host", "action", "patch_set"},
    )
    db["patch_records"].create_index(["host", "patch_set", "id"])
    db["patch_records"].create_index(["run_id"])


@MIGRATIONS(name="m004_progress_time_and_prediction")
def m004(db: Database) -> None:
    db["runs"].add_column("progress_at", float)  # when progress last advanced (stall detection)
    db["runs"].add_column("predicted_at", float)  # when loading should end, from earlier runs


@MIGRATIONS(name="m005_leases")
def m005(db: Database) -> None:
    db["leases"].create(
        {
            "id": int,
            "host": str,
            "gpus": str,  # JSON list of GPU indices; NULL: the whole host
            "run_id": int,
            "pid": int,  # the controller process that took the lease
            "pid_start": str,  # its start time, so a reused pid is not taken for it
            "hostname": str,  # the machine the controller runs on
            "heartbeat": float,
            "poll_max": float,  # the run's longest poll interval: how old a heartbeat may get
            "created_at": float,
        },
        pk="id",
        not_null={"host", "run_id", "pid", "hostname", "heartbeat", "poll_max", "created_at"},
    )
    db["leases"].create_index(["host"])
    db["leases"].create_index(["run_id"], unique=True)


@MIGRATIONS(name="m006_sweeps")
def m006(db: Database) -> None:
    db["sweeps"].create(
        {
            "id": int,
            "name": str,
            "file_hash": str,  # sha256 of the sweep file: the same name and bytes are the same sweep
            "path": str,
            "playbook": str,
            "doc": str,  # JSON of the parsed sweep file
            "notify": str,  # JSON list of URLs
            "status": str,  # running | succeeded | failed | cancelled
            "controller": str,  # "hostname:pid:start" of the process running it
            "heartbeat": float,
            "created_at": float,
            "ended_at": float,
        },
        pk="id",
        not_null={"name", "file_hash", "playbook", "status", "created_at"},
    )
    db["sweeps"].create_index(["name", "file_hash"], unique=True)
    db["sweep_points"].create(
        {
            "id": int,
            "sweep_id": int,
            "idx": int,
            "point": str,  # JSON of the point's spec differences (dotted keys)
            "host": str,
            "gpus": str,  # JSON, NULL: the whole host
            "status": str,  # queued | running | succeeded | failed | cancelled
            "fault": str,  # for failed points: job | fleet | setup
            "attempts": int,
            "run_id": int,  # the latest run of the point
            "reason": str,
        },
        pk="id",
        foreign_keys=[("sweep_id", "sweeps", "id")],
        not_null={"sweep_id", "idx", "point", "host", "status"},
        defaults={"attempts": 0},
    )
    db["sweep_points"].create_index(["sweep_id", "idx"], unique=True)
    db["sweep_events"].create(
        {"id": int, "sweep_id": int, "ts": float, "kind": str, "message": str, "data": str},
        pk="id",
        not_null={"ts", "kind"},
    )
    db["sweep_events"].create_index(["sweep_id", "id"])
    db["runs"].add_column("sweep_id", int)
    db["runs"].add_column("point", str)  # JSON of the sweep point's spec differences
    db["runs"].create_index(["sweep_id"])


@MIGRATIONS(name="m007_sweep_instance")
def m007(db: Database) -> None:
    # A sweep is its name, file hash and instance: a nightly entry's instance is the date, so an unchanged
    # file makes a new sweep every night; '' keeps "the same file again resumes it".
    db["sweeps"].add_column("instance", str, not_null_default="")
    for index in db.execute("PRAGMA index_list(sweeps)").fetchall():
        name, unique = index[1], index[2]
        columns = [row[2] for row in db.execute(f"PRAGMA index_info([{name}])").fetchall()]
        if unique and columns == ["name", "file_hash"]:
            db.execute(f"DROP INDEX [{name}]")
    db["sweeps"].create_index(["name", "file_hash", "instance"], unique=True)


@MIGRATIONS(name="m008_end_steps")
def m008(db: Database) -> None:
    # Which end steps ran and which patch sets a run applied, as data rather than read back from events.
    db["runs"].add_column("end_steps", str)  # JSON list of step names
    db["runs"].add_column("patches_applied", str)  # JSON list of patch set names
    # Earlier runs said both in events: `finished` (message: the step) and `patch` (data.applied).
    db.execute(
        "UPDATE runs SET end_steps = (SELECT json_group_array(message) FROM events"
        " WHERE run_id = runs.id AND kind = 'finished')"
        " WHERE EXISTS (SELECT 1 FROM events WHERE run_id = runs.id AND kind = 'finished')"
    )
    db.execute(
        "UPDATE runs SET patches_applied = (SELECT json_group_array(json_extract(data, '$.applied')) FROM events"
        " WHERE run_id = runs.id AND kind = 'patch' AND json_extract(data, '$.applied') IS NOT NULL)"
        " WHERE EXISTS (SELECT 1 FROM events WHERE run_id = runs.id AND kind = 'patch'"
        " AND json_extract(data, '$.applied') IS NOT NULL)"
    )


@MIGRATIONS(name="m009_last_line")
def m009(db: Database) -> None:
    db["runs"].add_column("last_line", str)  # the log's last line as of the last poll, for the live view


@MIGRATIONS(name="m010_scheduler_fields")
def m010(db: Database) -> None:
    # What a batch scheduler says of a run's job beyond its log.
    db["runs"].add_column("node", str)  # the node (list) the job runs on
    db["runs"].add_column("queue_reason", str)  # why it still waits in the queue ("Resources", "Priority")


# m011_eagle3_debug made the table of the sglang-eagle3-hidden-debug patch set's lines; that table is the
# EAGLE-3 plugin's own now (playbooks/eagle3_debug.py, its own migration set), which keeps one made here.


@MIGRATIONS(name="m012_dashboard_indexes")
def m012(db: Database) -> None:
    # The dashboard's runs table filters by host and playbook, newest first, over 100 000s of runs; an
    # index on one column also holds the rowid, so `WHERE host = ? ORDER BY id DESC LIMIT n` walks it.
    db["runs"].create_index(["host"])
    db["runs"].create_index(["playbook"])


@MIGRATIONS(name="m013_log_inode")
def m013(db: Database) -> None:
    # Which log file the offset is in, and the bytes just before it (hex): a rotation is told by identity,
    # a log truncated and grown past the offset again by its content, not by its size.
    db["runs"].add_column("log_inode", int)
    db["runs"].add_column("log_tail", str)


@MIGRATIONS(name="m014_run_labels")
def m014(db: Database) -> None:
    # What a person calls a run and what they note on it (`orch run --name/--tag/--note`, `orch tag`, `orch note`).
    db["runs"].add_column("name", str)
    db["runs"].add_column("tags", str)  # JSON list, filtered with json_each
    db["runs"].add_column("note", str)


@MIGRATIONS(name="m015_host_lease")
def m015(db: Database) -> None:
    db["runs"].add_column("host_lease", int, not_null_default=0)  # the run holds lease files on its host


@MIGRATIONS(name="m016_run_ids_never_reused")
def m016(db: Database) -> None:
    # AUTOINCREMENT: a run id once given is never given again, even after `orch rm` of the newest run, so an
    # id in a note, a chat message or a host's run dir names one run for good. SQLite cannot alter a key:
    # the table is rebuilt from its own definition (foreign keys are not enforced here, so the rows of
    # events and metrics keep pointing at the same ids), and its indexes made again.
    import re

    conn = db.conn
    (sql,) = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'runs'").fetchone()
    sql, found = re.subn(r"""(["\[`]?id["\]`]?\s+INTEGER\s+PRIMARY\s+KEY)(?!\s+AUTOINCREMENT)""",
                         r"\1 AUTOINCREMENT", sql, count=1, flags=re.IGNORECASE)
    if not found:
        return  # already so
    indexes = [row[0] for row in conn.execute(
        "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'runs' AND sql IS NOT NULL")]
    conn.execute(re.sub(r"""^CREATE TABLE\s+["\[`]?runs["\]`]?""", 'CREATE TABLE "runs_new"', sql))
    conn.execute("INSERT INTO runs_new SELECT * FROM runs")
    conn.execute("DROP TABLE runs")
    conn.execute("ALTER TABLE runs_new RENAME TO runs")
    for index in indexes:
        conn.execute(index)
    # ids removed before now stay used too, as far as the runs' events remember them
    (used,) = conn.execute("SELECT MAX((SELECT COALESCE(MAX(id), 0) FROM runs),"
                           " (SELECT COALESCE(MAX(run_id), 0) FROM events))").fetchone()
    conn.execute("DELETE FROM sqlite_sequence WHERE name = 'runs'")
    conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('runs', ?)", (used,))


@MIGRATIONS(name="m017_env_secrets_masked")
def m017(db: Database) -> None:
    # Specs stored before secrets were masked: their secret `env` values become the mask, as a spec stored
    # now has them (a run started again from one takes the value from orch's environment).
    _mask_stored_secrets(db)


def _mask_stored_secrets(db: Database) -> None:
    """Each stored spec's `env` masked by today's rule (secret_env.masked_values)."""
    import json

    from ..secret_env import masked_values

    def rows(sql: str) -> list[tuple[int, Any]]:
        found = []
        for rowid, text in db.conn.execute(sql).fetchall():
            try:
                value = json.loads(text) if text else None
            except ValueError:
                continue  # unreadable: left as it is, and said so where it is read
            if isinstance(value, dict):
                found.append((rowid, value))
        return found

    # the replaced text is zeroed where it lay, not left in the file's free pages
    (secure,) = db.conn.execute("PRAGMA secure_delete").fetchone()
    db.conn.execute("PRAGMA secure_delete = ON")
    for rowid, spec in rows("SELECT id, spec FROM runs"):
        if masked_values(spec) != spec:
            db.conn.execute("UPDATE runs SET spec = ? WHERE id = ?", (json.dumps(masked_values(spec)), rowid))
    for rowid, doc in rows("SELECT id, doc FROM sweeps"):  # the sweep file: its [spec] table
        if isinstance(doc.get("spec"), dict) and masked_values(doc["spec"]) != doc["spec"]:
            doc["spec"] = masked_values(doc["spec"])
            db.conn.execute("UPDATE sweeps SET doc = ? WHERE id = ?", (json.dumps(doc), rowid))
    db.conn.execute(f"PRAGMA secure_delete = {int(secure)}")


@MIGRATIONS(name="m018_scheduler_job_id")
def m018(db: Database) -> None:
    # A scheduler's job has columns of its own: its id and name were kept in `pid` and `pid_start`
    # ("slurm:<name>"), where a pid is a process of the host that orch may signal.
    db["runs"].add_column("job_id", int)
    db["runs"].add_column("job_name", str)
    db.conn.execute("UPDATE runs SET job_id = pid, job_name = substr(pid_start, 7), pid = NULL, pid_start = NULL"
                    " WHERE pid_start LIKE 'slurm:%'")


@MIGRATIONS(name="m019_browsing_views")
def m019(db: Database) -> None:
    # For people browsing the file (datasette, sqlite3): the runs as they read (times as ISO 8601 UTC text,
    # the duration, the spec's telling fields) and one row of latest metric values per run. orch reads
    # neither. JSON is read only where valid, so one damaged row cannot fail the whole view. A later migration
    # that rebuilds `runs` (as m016 does) drops these first and makes them again.
    def iso(column: str) -> str:
        return f"strftime('%Y-%m-%dT%H:%M:%SZ', {column}, 'unixepoch') AS {column.removesuffix('_at')}"

    def field(column: str, path: str, name: str) -> str:
        return f"CASE WHEN json_valid({column}) THEN json_extract({column}, '$.{path}') END AS {name}"

    run_columns = [
        "id", "name", "playbook", "host", "status", "phase",
        iso("created_at"), iso("started_at"), iso("ended_at"), "ROUND(ended_at - started_at, 3) AS duration_s",
        "exit_code", "reason", field("error", "message", "error"),
        *(field("spec", name, name) for name in ("cmd", "model", "draft_model", "tp", "gpus", "patches")),
        "CASE WHEN json_valid(tags) THEN (SELECT group_concat(value, ' ') FROM json_each(runs.tags)) END AS tags",
        "note", "sweep_id", "point", "node", "COALESCE(pid, job_id) AS job", "remote_dir",
    ]
    db.create_view("runs_view", "SELECT\n    " + ",\n    ".join(run_columns) + "\nFROM runs")
    # The metric names orch's log readers and playbooks record most; `metrics` holds every name's value.
    common = ["gen_throughput", "accept_len", "accept_rate", "load_weight_s", "output_throughput",
              "median_ttft_ms", "median_itl_ms", "tokens_per_s", "train/loss"]
    pivot_columns = [
        "run_id", "runs.playbook", "runs.host",
        *(f"MAX(CASE WHEN latest.name = '{name}' THEN latest.value END) AS [{name}]" for name in common),
        "json_group_object(latest.name, latest.value) AS metrics",
    ]
    db.create_view("metrics_pivot", (
        "WITH latest AS (\n"  # each run's last sample of each name, as `orch status` shows it
        "    SELECT run_id, name, value FROM metrics\n"
        "    WHERE id IN (SELECT MAX(id) FROM metrics GROUP BY run_id, name)\n"
        "    ORDER BY run_id, name\n"
        ")\n"
        "SELECT\n    " + ",\n    ".join(pivot_columns) + "\n"
        "FROM latest JOIN runs ON runs.id = latest.run_id\n"
        "GROUP BY run_id"))


@MIGRATIONS(name="m020_nodes")
def m020(db: Database) -> None:
    # A run across several hosts: a record per node, each followed by its host's watcher like any run;
    # the head (rank 0) is the run, the others name it as their parent.
    db["runs"].add_column("parent_id", int)
    db["runs"].add_column("node_rank", int)
    db.conn.execute("CREATE INDEX IF NOT EXISTS runs_parent ON runs (parent_id) WHERE parent_id IS NOT NULL")


@MIGRATIONS(name="m021_env_secrets_masked_wider")
def m021(db: Database) -> None:
    # The secret rule grew (GITHUB_PAT, DB_PASS, a URL with a password): specs stored before are masked by it.
    _mask_stored_secrets(db)


@MIGRATIONS(name="m022_end_claims_and_cancelling")
def m022(db: Database) -> None:
    # The end steps under way and who runs each ({step: {"by": controller, "at": epoch}}): a step whose
    # claimer died is taken over. A step in end_steps and not here is over (so are those of older rows).
    db["runs"].add_column("end_claims", str)
    # A `cancelling` run (its host did not answer the stop): the status it ends with once its job is stopped.
    db["runs"].add_column("ending_as", str)


@MIGRATIONS(name="m023_receipts")
def m023(db: Database) -> None:
    # Each run's receipt (what produced its numbers: engine, patches, argv, model, hardware), as JSON, and
    # the reason its numbers are invalid (NULL: valid): never a sweep's best, never an objective value.
    db["runs"].add_column("receipt", str)
    db["runs"].add_column("invalid", str)
