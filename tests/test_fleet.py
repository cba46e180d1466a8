"""Many hosts at once, with the real sshd fleet: a dead or a silent host costs its own timeout, never
the others', and shows as such. Plus `--json` on every listing command, and `orch status` at scale."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest

from orchestrator.store import Store

from orchtest import FAST, Orch


@pytest.fixture
def orch(tmp_path, ssh_fleet_restarts) -> Orch:
    overrides = {f"test{i}": {"workdir": str(tmp_path / f"remote{i}")} for i in (1, 2)}
    return Orch(tmp_path / "ws", ssh_fleet_restarts.hosts_toml(**overrides))


@contextmanager
def frozen(server):
    """The host accepts TCP connections (the kernel's backlog) but never answers: a hung machine."""
    pid = server._proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def timed(orch: Orch, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    res = orch(*args, timeout=60)
    return res, time.monotonic() - t0


def test_hosts_check_with_a_dead_host(orch, ssh_fleet_restarts):
    ssh_fleet_restarts.server(2).stop()
    res, wall = timed(orch, "hosts", "--check", "--json", "--timeout", "5")
    assert res.returncode == 1
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["test1"]["ok"] and rows["test1"]["uname"].startswith("Linux") and rows["test1"]["seconds"] < 3
    assert not rows["test2"]["ok"] and "unreachable" in rows["test2"]["error"]
    assert wall < 5 + 4


def test_hosts_check_with_a_silent_host(orch, ssh_fleet_restarts):
    with frozen(ssh_fleet_restarts.server(2)):
        res, wall = timed(orch, "hosts", "--check", "--json", "--timeout", "2")
    assert res.returncode == 1
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["test1"]["ok"] and rows["test1"]["seconds"] < 2
    assert not rows["test2"]["ok"] and "test2: unreachable" in rows["test2"]["error"]
    assert wall < 2 + 1 + 4  # its timeout, the margin for probe's own, start-up


def test_gpus_all_with_a_silent_host(orch, ssh_fleet_restarts):
    with frozen(ssh_fleet_restarts.server(2)):
        res, wall = timed(orch, "gpus", "--all", "--json", "--timeout", "2")
    assert res.returncode == 1
    found = json.loads(res.stdout)
    assert found["test1"] == {"name": "test1", "ok": True, "error": None, "nvidia_smi": False, "gpus": []}
    assert found["test2"]["ok"] is False and "test2: unreachable" in found["test2"]["error"]
    assert wall < 2 + 1 + 4


def test_status_refresh_with_a_silent_host(orch, ssh_fleet_restarts):
    quick = orch("run", "command", "--host", "test1", "--detach", "--set", "cmd=sleep 0.3", *FAST, check=0)
    slow = orch("run", "command", "--host", "test2", "--detach", "--set", "cmd=sleep 30", *FAST, check=0)
    quick_id, slow_id = int(quick.stdout.strip()), int(slow.stdout.strip())
    time.sleep(0.6)
    try:
        with frozen(ssh_fleet_restarts.server(2)):
            res, wall = timed(orch, "status", "--refresh", "--json", "--timeout", "2")
        assert res.returncode == 0, res.stderr
        docs = {d["id"]: d for d in json.loads(res.stdout)}
        assert docs[quick_id]["status"] == "succeeded"  # test1 was polled
        assert docs[slow_id]["status"] == "running"
        assert f"test2: test2: unreachable: no answer within 2 s; runs {slow_id} not refreshed" in res.stderr
        assert wall < 2 + 5
    finally:
        orch("cancel", str(slow_id), "--grace", "0.5")


def test_every_listing_command_speaks_json(orch):
    for args in (["status"], ["hosts"], ["gpus"], ["patch", "list"], ["patch", "status"], ["cron", "list"]):
        res = orch(*args, "--json")
        assert res.returncode == 0, (args, res.stderr)
        assert isinstance(json.loads(res.stdout), (list, dict)), args


def test_status_queries_use_indexes(tmp_path):
    """The queries of `orch status` (newest 50, active runs, latest metrics, events) read only what they
    return: no full scan, no sort of the whole table."""
    store = Store(tmp_path / "orch.db")
    store.db["runs"].insert_all(
        ({"playbook": "command", "host": f"h{i % 16}", "status": "running" if i % 5000 == 0 else "succeeded",
          "phase": "finished", "spec": "{}", "created_at": float(i), "log_offset": 0} for i in range(20_000)),
        batch_size=5000)
    store.db["metrics"].insert_all(
        ({"run_id": 1 + i // 4, "name": f"m{i % 2}", "value": 1.0, "ts": float(i)} for i in range(40_000)),
        batch_size=5000)

    def plan(sql: str, *args: object) -> list[str]:
        return [r[3] for r in store.conn.execute("EXPLAIN QUERY PLAN " + sql, args)]

    # rowid order backwards, stopping at the limit
    assert plan("SELECT * FROM runs ORDER BY id DESC LIMIT ?", 50) == ["SCAN runs"]
    active = plan("SELECT * FROM runs WHERE status IN (?, ?) ORDER BY id DESC LIMIT ?", "running", "pending", 50)
    assert active[0].startswith("SEARCH runs USING INDEX idx_runs_status"), active
    latest = plan("SELECT name, value FROM metrics WHERE id IN"
                  " (SELECT MAX(id) FROM metrics WHERE run_id = ? GROUP BY name) ORDER BY name", 7)
    assert [p.split(" USING")[0] for p in latest if p.startswith(("SEARCH", "SCAN"))] == ["SEARCH metrics"] * 2
    assert "idx_metrics_run_id_name_id" in " ".join(latest)
    events = plan("SELECT ts, kind, message, data FROM events WHERE run_id = ? ORDER BY id", 7)
    assert events == ["SEARCH events USING INDEX idx_events_run_id_id (run_id=?)"]
    t0 = time.perf_counter()
    runs = store.list_runs(limit=50)
    for r in runs:
        store.latest_metrics(r.id)
    assert len(runs) == 50 and time.perf_counter() - t0 < 0.5


def test_status_imports_nothing_heavy(tmp_path):
    env = {**os.environ, "ORCH_HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "orchestrator", "status"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    modules = {line.split("|")[-1].strip().split(".")[0] for line in res.stderr.splitlines() if "|" in line}
    assert "orchestrator" in modules and "sqlite_utils" in modules  # the measurement sees imports
    assert not modules & {"fabric", "paramiko", "invoke", "matplotlib", "torch", "crontab", "transformers"}
