"""Named schema migrations, applied in order on every open (never edit one that has shipped)."""

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

migrations = Migrations("orch")


@migrations(name="m001_runs_events_metrics")
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


@migrations(name="m002_run_watch_fields")
def m002(db: Database) -> None:
    db["runs"].add_column("stalled", int, not_null_default=0)
    db["runs"].add_column("watcher", str)  # "hostname:pid" of the controller watching the run
    db["runs"].add_column("heartbeat", float)
    db["runs"].create_index(["status"])


@migrations(name="m003_patch_records")
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
