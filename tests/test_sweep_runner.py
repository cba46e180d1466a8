"""A sweep run in process on the local host: the runner, the policy and the rows together, in a second."""

from __future__ import annotations

from pathlib import Path

from orchestrator import sweep
from orchestrator.config.workspace import Workspace
from orchestrator.store import Store

FILE = """name = "ff"
playbook = "command"
hosts = ["local"]
retries = 3
fail_fast = true
[spec]
cmd = "exit $CODE"
poll_min = 0.05
poll_max = 0.3
[matrix]
"env.CODE" = ["0", "3", "1"]
"""


def test_a_job_failure_is_not_retried_cancels_the_queue_and_a_rerun_resumes(tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    path = tmp_path / "s.toml"
    path.write_text(FILE)
    lines: list[str] = []
    doc = sweep.run(ws, path, echo=lines.append)
    assert doc["status"] == "failed"
    assert [(p["status"], p["fault"], p["runs"]) for p in doc["points"]] == [
        ("succeeded", None, 1), ("failed", "job", 1), ("cancelled", None, 0)]
    assert "fail_fast: point 1 failed; 1 queued point(s) cancelled" in lines
    store = Store(ws.db_path)
    moves = [(e["data"]["point"], e["data"]["to"]) for e in sweep.events(store, doc["id"]) if e["kind"] == "point"]
    assert moves == [(0, "running"), (0, "succeeded"), (1, "running"), (1, "failed"), (2, "cancelled")]
    assert [e["kind"] for e in sweep.events(store, doc["id"])][-2:] == ["status", "finished"]
    # the same file again: only the cancelled point runs; the job's own failure stays
    again = sweep.run(ws, path, echo=lines.append)
    assert [(p["status"], p["fault"], p["runs"]) for p in again["points"]] == [
        ("succeeded", None, 1), ("failed", "job", 1), ("failed", "job", 1)]
    assert again["id"] == doc["id"] and "sweep 1 (ff): 3 points on local, 2 already done" in lines
    store.close()
