import json
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

from orchestrator.errors import NotFound, TransitionError
from orchestrator.store import Store, migrations
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import ALLOWED, TERMINAL, Status


def old_schema(tmp_path: Path, stop_before: str) -> tuple[Path, Store]:
    """A database at an earlier schema: every migration before `stop_before` applied."""
    path = tmp_path / "orch.db"
    old = Store.__new__(Store)
    old.path = path
    old.conn = sqlite3.connect(path, isolation_level=None)
    old.db = Database(old.conn)
    old.migrate(stop_before=stop_before)
    return path, old


def test_blank_database_gets_every_migration(tmp_path):
    store = Store(tmp_path / "orch.db")
    applied = [name for (name,) in store.conn.execute("SELECT name FROM _sqlite_migrations ORDER BY id")]
    assert applied == migrations.names()
    assert {"runs", "events", "metrics", "patch_records"} <= set(store.db.table_names())
    assert store.conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("stop_before", migrations.names()[1:])
def test_each_earlier_schema_migrates(tmp_path, stop_before):
    path, old = old_schema(tmp_path, stop_before)
    old.conn.execute(
        "INSERT INTO runs (playbook, host, status, phase, spec, created_at, log_offset)"
        " VALUES ('command', 'local', 'running', 'loading', '{}', 1.0, 10)"
    )
    old.conn.close()
    store = Store(path)
    run = store.get_run(1)
    assert run.status == "running" and run.log_offset == 10 and run.stalled == 0
    assert store.patch_records("local") == []


@pytest.mark.parametrize("stop_before", migrations.names())
def test_the_quick_pending_check_agrees_with_sqlite_utils(tmp_path, stop_before):
    path, old = old_schema(tmp_path, stop_before)
    assert migrations.pending(old.conn)[0] == stop_before
    assert migrations.pending(old.conn) == [m.name for m in migrations.MIGRATIONS.pending(old.db)]
    old.conn.close()
    store = Store(path)
    assert migrations.pending(store.conn) == [] == migrations.MIGRATIONS.pending(store.db)


def test_a_new_file_has_every_migration_pending(tmp_path):
    conn = sqlite3.connect(tmp_path / "orch.db")
    assert migrations.pending(conn) == migrations.names()
    assert migrations.names() == [m.name for m in migrations.MIGRATIONS.pending(Database(conn))]
    assert migrations.MIGRATIONS.migrations_table == Migrations.migrations_table  # the table it reads is theirs


def test_a_removed_runs_id_is_never_given_again(tmp_path):
    store = Store(tmp_path / "orch.db")
    ids = [store.create_run("command", "local", {}) for _ in range(3)]
    store.conn.execute("DELETE FROM runs WHERE id = ?", (ids[-1],))  # as `orch rm` of the newest run does
    assert store.next_run_id() == ids[-1] + 1
    assert store.create_run("command", "local", {}) == ids[-1] + 1


def test_ids_removed_before_the_never_reused_schema_stay_taken(tmp_path):
    path, old = old_schema(tmp_path, "m016_run_ids_never_reused")
    add = ("INSERT INTO runs (playbook, host, status, phase, spec, created_at, log_offset)"
           " VALUES ('command', 'local', 'running', 'loading', '{}', 1.0, 10)")
    for _ in range(3):
        old.conn.execute(add)
    old.conn.execute("INSERT INTO events (run_id, ts, kind, message) VALUES (3, 1.0, 'status', 'pending')")
    old.conn.execute("INSERT INTO metrics (run_id, name, value, ts) VALUES (2, 'tok_s', 88.8, 1.0)")
    old.conn.execute("DELETE FROM runs WHERE id = 3")  # its events were left, as an old `rm` may have
    old.conn.close()
    store = Store(path)
    assert [r.id for r in store.list_runs()] == [2, 1]
    assert store.latest_metrics(2) == {"tok_s": 88.8}
    assert store.create_run("command", "local", {}) == 4
    indexes = {r[0] for r in store.conn.execute("SELECT name FROM sqlite_master WHERE tbl_name = 'runs'"
                                                " AND type = 'index'")}
    assert {"idx_runs_status", "idx_runs_host", "idx_runs_playbook", "idx_runs_sweep_id"} <= indexes


def test_a_scheduler_job_recorded_in_the_pid_column_moves_to_its_own(tmp_path):
    path, old = old_schema(tmp_path, "m018_scheduler_job_id")
    add = ("INSERT INTO runs (playbook, host, status, spec, created_at, pid, pid_start)"
           " VALUES ('command', ?, 'running', '{}', 1.0, ?, ?)")
    old.conn.execute(add, ("cluster", 991, "slurm:orch-1"))
    old.conn.execute(add, ("gpu01", 4242, "123456"))
    old.conn.close()
    store = Store(path)
    slurm_run, host_run = store.get_run(1), store.get_run(2)
    assert (slurm_run.pid, slurm_run.job_id, slurm_run.job_name) == (None, 991, "orch-1")
    assert str(slurm_run.job) == "Slurm job 991" and slurm_run.job.columns() == {"job_id": 991, "job_name": "orch-1"}
    assert (host_run.pid, host_run.pid_start, host_run.job_id) == (4242, "123456", None)
    assert str(host_run.job) == "pid 4242" and not host_run.job.scheduled


def test_sweeps_before_instances_keep_their_identity(tmp_path):
    path, old = old_schema(tmp_path, "m007_sweep_instance")
    add = "INSERT INTO sweeps (name, file_hash, playbook, status, created_at{}) VALUES ('s', 'h', 'command', 'queued', 1{})"
    old.conn.execute(add.format("", ""))
    old.conn.close()
    store = Store(path)
    assert store.conn.execute("SELECT instance FROM sweeps").fetchall() == [("",)]
    store.conn.execute(add.format(", instance", ", '2031-01-01'"))  # the same file, another night
    with pytest.raises(sqlite3.IntegrityError):
        store.conn.execute(add.format(", instance", ", '2031-01-01'"))


def test_an_up_to_date_database_opens_without_sqlite_utils(tmp_path):
    path = tmp_path / "orch.db"
    Store(path).close()
    code = ("import sys; from orchestrator.store import Store; Store(sys.argv[1]);"
            " print('sqlite_utils' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_transitions_are_checked_and_evented(tmp_path):
    store = Store(tmp_path / "orch.db")
    rid = store.create_run("command", "local", {"cmd": "true"})
    with pytest.raises(TransitionError):
        transition(store, rid, Status.RUNNING)
    for s in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, rid, s)
    transition(store, rid, Status.FAILED, "exit code 3", exit_code=3)
    run = store.get_run(rid)
    assert (run.status, run.exit_code, run.reason) == ("failed", 3, "exit code 3")
    assert run.started_at and run.ended_at >= run.started_at
    assert [e["message"] for e in store.events(rid)] == [
        "pending", "preparing", "launching", "running", "failed: exit code 3"
    ]
    with pytest.raises(TransitionError):
        transition(store, rid, Status.SUCCEEDED)
    with pytest.raises(NotFound):
        store.get_run(999)


def test_terminal_states_have_no_way_out():
    assert all(not ALLOWED[s] for s in TERMINAL)
    assert all(ALLOWED[s] for s in Status if s not in TERMINAL)


def test_a_failed_transition_writes_nothing(tmp_path):
    store = Store(tmp_path / "orch.db")
    rid = store.create_run("command", "local", {})
    with pytest.raises(ValueError):
        transition(store, rid, Status.PREPARING, status="x")
    assert store.get_run(rid).status == "pending"
    assert len(store.events(rid)) == 1


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "orch.db"
    Store(path)

    def writer(n: int) -> None:
        s = Store(path)
        for i in range(50):
            rid = s.create_run("command", f"h{n}", {"i": i})
            s.add_metrics(rid, [("x", float(i), i)], 1.0)
        s.close()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = Store(path)
    assert s.conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 200
    assert s.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0] == 200
    assert s.conn.execute("SELECT COUNT(*) FROM metrics").fetchone()[0] == 200


def test_removed_runs_take_their_rows_and_keep_their_ids(tmp_path):
    store = Store(tmp_path / "orch.db")
    kept, gone = store.create_run("command", "local", {}), store.create_run("command", "local", {})
    for rid in (kept, gone):
        store.add_metrics(rid, [("x", 1.0, 1)], 1.0)
        store.conn.execute("INSERT INTO leases (host, run_id, pid, hostname, heartbeat, poll_max, created_at)"
                           " VALUES ('local', ?, 1, 'h', 1.0, 1.0, 1.0)", (rid,))
    store.delete_run(gone)
    with pytest.raises(NotFound):
        store.get_run(gone)
    for table in ("events", "metrics", "leases"):
        owners = [r for (r,) in store.conn.execute(f"SELECT DISTINCT run_id FROM {table}")]
        assert owners == [kept], table
    assert store.newest_run_id() == kept and store.next_run_id() == gone + 1


def test_runs_ended_before_a_time_leave_out_active_and_sweep_runs(tmp_path):
    store = Store(tmp_path / "orch.db")
    ids = [store.create_run("command", "local", {}) for _ in range(5)]
    old, recent, active, in_sweep, never_started = ids
    for rid in (old, recent, in_sweep):
        transition(store, rid, Status.CANCELLED)
    store.update_run(old, ended_at=100.0)
    store.update_run(recent, ended_at=300.0)
    store.update_run(in_sweep, ended_at=100.0, sweep_id=1)
    store.update_run(active, created_at=100.0)
    transition(store, never_started, Status.FAILED, ended_at=None)
    store.update_run(never_started, created_at=150.0)
    assert [r.id for r in store.ended_before(200.0)] == [old, never_started]


def test_an_end_step_is_claimed_once(tmp_path):
    store = Store(tmp_path / "orch.db")
    rid = store.create_run("command", "local", {})
    assert store.claim_end_step(rid, "fetch") and store.claim_end_step(rid, "revert")
    assert not store.claim_end_step(rid, "fetch")
    assert store.get_run(rid).end_steps == ["fetch", "revert"]


def test_narrow_reads_of_a_run(tmp_path):
    store = Store(tmp_path / "orch.db")
    assert store.newest_run_id() == 0 and store.created_at(1) is None
    first, second = store.create_run("command", "local", {}), store.create_run("command", "local", {})
    store.update_run(first, created_at=1234.5, watcher="here:1")
    store.update_run(second, log_offset=77)
    assert store.created_at(first) == 1234.5
    assert store.log_position(second) == (77, Status.PENDING)
    assert store.count_runs(after_id=0, watcher="here:1") == 1
    assert store.count_runs(after_id=first, watcher="here:1") == 0
    assert store.count_runs(after_id=first) == 1


def test_views_for_browsing_read_with_plain_sqlite3(tmp_path):
    path = tmp_path / "orch.db"
    store = Store(path)
    spec = {"model": "/models/kimi", "tp": 8, "gpus": [0, 1], "patches": ["eagle3-fix"], "env": {}}
    served = store.create_run("serve_eagle3", "gpu01", spec)
    for status in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, served, status)
    transition(store, served, Status.FAILED, "exit code 3", exit_code=3)
    store.update_run(served, created_at=1_700_000_000.0, started_at=1_700_000_010.25, ended_at=1_700_000_100.5,
                     error={"kind": "oom", "message": "CUDA out of memory"})
    store.label_run(served, tags=["nightly", "kimi"], note="first try")
    store.add_metrics(served, [("gen_throughput", 100.0, 1), ("gen_throughput", 120.0, 2), ("train/loss", 0.5, 1),
                               ("rare_metric", 3.0, None)], ts=1.0)
    damaged = store.create_run("command", "local", {"cmd": "true"})
    store.conn.execute("UPDATE runs SET spec = 'not json', tags = '[' WHERE id = ?", (damaged,))
    bare = store.create_run("command", "local", {"cmd": "sleep 1"})
    store.add_metrics(bare, [("accept_len", 2.5, 1)], ts=1.0)
    store.close()

    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    runs = {r["id"]: dict(r) for r in conn.execute("SELECT * FROM runs_view")}
    assert {k: runs[served][k] for k in ("created", "started", "ended", "duration_s", "status", "exit_code",
                                         "reason", "error", "model", "tp", "gpus", "patches", "tags", "note")} == {
        "created": "2023-11-14T22:13:20Z", "started": "2023-11-14T22:13:30Z", "ended": "2023-11-14T22:15:00Z",
        "duration_s": 90.25, "status": "failed", "exit_code": 3, "reason": "exit code 3",
        "error": "CUDA out of memory", "model": "/models/kimi", "tp": 8, "gpus": "[0,1]",
        "patches": '["eagle3-fix"]', "tags": "nightly kimi", "note": "first try"}
    assert (runs[damaged]["cmd"], runs[damaged]["tags"], runs[damaged]["playbook"]) == (None, None, "command")
    assert (runs[bare]["cmd"], runs[bare]["started"], runs[bare]["duration_s"]) == ("sleep 1", None, None)

    pivot = {r["run_id"]: dict(r) for r in conn.execute("SELECT * FROM metrics_pivot")}
    assert set(pivot) == {served, bare}  # a run without metrics has no row
    assert (pivot[served]["gen_throughput"], pivot[served]["train/loss"], pivot[served]["accept_len"]) == (
        120.0, 0.5, None)
    assert json.loads(pivot[served]["metrics"]) == {"gen_throughput": 120.0, "train/loss": 0.5, "rare_metric": 3.0}
    assert (pivot[bare]["accept_len"], pivot[bare]["host"], pivot[bare]["gen_throughput"]) == (2.5, "local", None)
