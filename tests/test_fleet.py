"""Many hosts at once, with the real sshd fleet: a dead or a silent host costs its own timeout, never
the others', and shows as such. Plus `--json` on every listing command, and `orch status` at scale."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from orchtest import FAST, release, stop_background_watchers, wait_for_file

from orchestrator.host import fleet
from orchestrator.store import Store


@pytest.fixture
def orch_hosts(orch_hosts, ssh_fleet_restarts) -> str:
    """The fleet's hosts as usual; a server a test stopped is started again after it."""
    return orch_hosts


@contextmanager
def frozen(server):
    """The host accepts TCP connections (the kernel's backlog) but never answers: a hung machine."""
    pid = server._proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


# How long a silent host holds up these commands (its timeout, plus start-up) is measured by
# bench/timeouts.py; here, what they say. A timeout of 10 s leaves the live host room to answer on a
# loaded machine; without --timeout the silent host would cost 15 s (hosts) or 30 s (gpus, status).
TIMEOUT = "10"
SILENT = r"test2: unreachable: no answer within 1[01] s"  # --timeout's, +1 where the probe's own comes first


def test_fan_out_a_silent_item_costs_its_own_timeout_never_the_others():
    """fleet.fan_out in process: an item that never returns is Unreachable once its timeout passed; the
    others' results are in; the call returns (a hung host is never waited for)."""
    never = threading.Event()
    answered: list[str] = []

    def one(name: str) -> str:
        if name == "hung":
            never.wait()
        answered.append(name)
        return f"{name} ok"

    done: dict = {}
    caller = threading.Thread(target=lambda: done.update(fleet.fan_out({n: n for n in ("a", "hung", "b")}, one, 2.0)))
    caller.start()
    caller.join(60)
    never.set()
    assert not caller.is_alive()
    assert done["a"] == "a ok" and done["b"] == "b ok" and sorted(answered[:2]) == ["a", "b"]
    assert isinstance(done["hung"], fleet.Unreachable) and "no answer within 2 s" in str(done["hung"])


def test_hosts_check_with_a_dead_host(orch, ssh_fleet_restarts):
    ssh_fleet_restarts.server(2).stop()
    res = orch("hosts", "--check", "--json", "--timeout", TIMEOUT, timeout=60)
    assert res.returncode == 1
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["test1"]["ok"] and rows["test1"]["uname"].startswith("Linux")
    assert not rows["test2"]["ok"] and "unreachable" in rows["test2"]["error"]
    assert "no answer within" not in rows["test2"]["error"]  # refused: known at once, not at the timeout


def test_hosts_check_and_gpus_all_with_a_silent_host(orch, ssh_fleet_restarts):
    """Both at once, while test2 is frozen: each says test2 did not answer within its timeout, and test1
    answered."""
    with frozen(ssh_fleet_restarts.server(2)):
        hosts = orch.spawn("hosts", "--check", "--json", "--timeout", TIMEOUT)
        gpus = orch.spawn("gpus", "--all", "--json", "--timeout", TIMEOUT)
        (hosts_out, hosts_err), (gpus_out, gpus_err) = hosts.communicate(timeout=60), gpus.communicate(timeout=60)
    assert hosts.returncode == 1, hosts_err
    rows = {r["name"]: r for r in json.loads(hosts_out)}
    assert rows["test1"]["ok"], rows
    assert not rows["test2"]["ok"] and re.search(SILENT, rows["test2"]["error"]), rows["test2"]
    assert gpus.returncode == 1, gpus_err
    found = json.loads(gpus_out)
    assert found["test1"] == {"name": "test1", "ok": True, "error": None, "nvidia_smi": False, "gpus": []}
    assert found["test2"]["ok"] is False and re.search(SILENT, found["test2"]["error"]), found["test2"]


def test_status_refresh_with_a_silent_host(orch, ssh_fleet_restarts, tmp_path):
    """`status --refresh` polls test1 while test2 is frozen. Nobody else watches these runs (their
    watchers are killed), so the quick run's end is known only if the refresh polled test1."""
    hold = tmp_path / "hold"
    quick = json.loads(orch("run", "command", "--host", "test1", "--detach", "--json",
                            "--set", f"cmd=while [ ! -e {hold} ]; do sleep 0.05; done", *FAST, check=0).stdout)
    slow = orch("run", "command", "--host", "test2", "--detach", "--set", "cmd=sleep 300", *FAST, check=0)
    quick_id, slow_id = quick["id"], int(slow.stdout.strip())
    stop_background_watchers(Path(os.environ["HOME"]))
    remote_dir = quick["remote_dir"]
    release(hold)
    wait_for_file(Path(remote_dir) / ".orch" / "exit_code")
    try:
        with frozen(ssh_fleet_restarts.server(2)):
            res = orch("status", "--refresh", "--json", "--timeout", TIMEOUT, timeout=60)
        assert res.returncode == 0, res.stderr
        docs = {d["id"]: d for d in json.loads(res.stdout)}
        assert docs[quick_id]["status"] == "succeeded"  # test1 was polled
        assert docs[slow_id]["status"] == "running"
        assert f"test2: test2: unreachable: no answer within {TIMEOUT} s; runs {slow_id} not refreshed" in res.stderr
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
    runs = store.list_runs(limit=50)
    for r in runs:
        store.latest_metrics(r.id)
    assert len(runs) == 50  # how fast: bench/status_startup.py


def test_status_imports_nothing_heavy(tmp_path):
    env = {**os.environ, "ORCH_HOME": str(tmp_path)}
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "orchestrator", "status"],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    modules = {line.split("|")[-1].strip().split(".")[0] for line in res.stderr.splitlines() if "|" in line}
    assert "orchestrator" in modules and "sqlite_utils" in modules  # the measurement sees imports
    assert not modules & {"fabric", "paramiko", "invoke", "matplotlib", "torch", "crontab", "transformers"}
