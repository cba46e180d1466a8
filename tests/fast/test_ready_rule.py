"""One rule for "the run is ready" (what `--until-ready` waits for), whoever watches: the host's watcher
reading the log, or another command following the record."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator import runflow
from orchestrator.config.workspace import Workspace
from orchestrator.host import health
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.watch.follow import _ready_rule


@pytest.mark.parametrize(("phase", "answering", "ready"), [
    ("loading", None, False), ("capturing", None, False), ("ready", None, True),
    ("running", None, True),  # the ready line fell between two reads
    ("ready", False, False),  # the log says ready; the endpoint has not answered
    ("ready", True, True), ("running", True, True), ("loading", True, False), ("finished", None, False),
])
def test_the_rule(phase: str, answering: bool | None, ready: bool) -> None:
    assert health.ready(phase, answering) is ready


def running(store: Store, playbook: str, spec: dict, phase: str) -> int:
    run_id = store.create_run(playbook, "local", spec)
    for status in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, status)
    transition(store, run_id, Status.RUNNING, pid=4242, pid_start="1")
    store.update_run(run_id, phase=phase)
    return run_id


def test_a_follower_of_the_record_waits_for_the_health_endpoint_too(tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    run_id = running(store, "serve-eagle3", {"model": "/m", "draft_model": "/d", "port": 30123}, "ready")
    run = runflow.open_run(ws, store, run_id)
    ready = _ready_rule(run)
    assert not ready(run.record)
    store.add_event(run_id, "health", "health endpoint answers (HTTP 200)", {"answered": True, "code": 200})
    assert ready(run.record)
    store.add_event(run_id, "health", "health endpoint stopped answering", {"down_since": 1.0, "code": None})
    assert not ready(run.record)

    command = running(store, "command", {"cmd": "true"}, "running")  # no endpoint: the log alone decides
    assert _ready_rule(runflow.open_run(ws, store, command))(store.get_run(command))
    store.close()
