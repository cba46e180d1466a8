import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sqlite_utils import Database

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
        transition(store, rid, Status.PREPARING, **{"status": "x"})
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
