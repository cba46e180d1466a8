"""Numbers orch reads back from a run's own files (`.orch/started_at`, `ended_at`, `exit_code`: a job may
write anything there) and the host's clock: bounded as a spec's numbers are, so neither a job writing
`inf` nor a host clock hours off can crash `orch status` or the dashboard, or give a negative duration."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from orchtest import in_process
from recording import FakeExecutor

from orchestrator.config.workspace import Workspace
from orchestrator.host.launch import JobState, pushed_state
from orchestrator.runflow.recorder import Recorder, WatchOptions
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.ui import pages, table
from orchestrator.ui.server import JSON


def test_what_the_agent_reads_from_a_runs_files_is_bounded() -> None:
    for bad in (math.inf, -math.inf, math.nan, 1e300, -1e300, 10**400, "12", True):
        doc = {"started_at": bad, "ended_at": bad, "size": bad, "offset": bad, "exit_code": 10**30, "inode": 5}
        state = pushed_state(json.loads(json.dumps(doc)))  # as the agent's JSON line brings it (Infinity, NaN)
        assert state.started_at is None and state.ended_at is None and state.exit_code is None
        assert state.size == 0 and state.offset == 0
    assert pushed_state({"exit_code": -9, "started_at": 1.5e9}).exit_code == -9


def running(store: Store) -> int:
    run_id = store.create_run("command", "local", {"cmd": "true"})
    for status in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, status)
    store.update_run(run_id, remote_dir=f"/nonexistent/r{run_id}")
    transition(store, run_id, Status.RUNNING, pid=4242, pid_start="1")
    return run_id


def job_state(started_at: float | None, ended_at: float | None = None, exit_code: int | None = None) -> JobState:
    return JobState(alive=exit_code is None, exit_code=exit_code, size=0, offset=0, data=b"",
                    started_at=started_at, ended_at=ended_at)


def record(store: Store, run_id: int, state: JobState) -> None:
    w = Recorder(store, run_id, FakeExecutor(), WatchOptions(poll_min=30, poll_max=600))  # type: ignore[arg-type]
    w.stage(state)
    with store.tx():
        w.commit()
    w.settle()


@pytest.mark.parametrize("given", ["2 h ahead", "2 h behind", "inf", "1e300", "-5", "0"])
def test_a_host_clock_hours_off_or_a_job_writing_its_own_times_gives_no_negative_duration(
        tmp_path: Path, given: str) -> None:
    store = Store(tmp_path / "orch.db")
    run_id = running(store)
    launched = store.get_run(run_id).started_at
    assert launched is not None
    at = time.time() + {"2 h ahead": 7200, "2 h behind": -7200}[given] if " h " in given else float(given)
    record(store, run_id, job_state(started_at=at))
    record(store, run_id, job_state(started_at=at, ended_at=at + 10 if math.isfinite(at) else at, exit_code=0))
    run = store.get_run(run_id)
    assert run.status is Status.SUCCEEDED and run.started_at == launched  # this machine's own stands
    assert run.ended_at is not None and launched <= run.ended_at <= time.time()
    store.close()


def test_a_host_clock_in_step_gives_the_jobs_own_times(tmp_path: Path) -> None:
    store = Store(tmp_path / "orch.db")
    run_id = running(store)
    store.update_run(run_id, created_at=time.time() - 10)  # made 10 s ago, its job began 5 s ago, ended 1 s after
    began = time.time() - 5
    record(store, run_id, job_state(started_at=began))
    record(store, run_id, job_state(started_at=began, ended_at=began + 1, exit_code=0))
    run = store.get_run(run_id)
    assert (run.started_at, run.ended_at) == (began, began + 1)
    store.close()


def test_times_a_database_already_holds_out_of_range_read_as_unknown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An older orch recorded whatever the job wrote: `orch status` (every form) and the dashboard's pages
    still answer, the damaged times shown as unknown."""
    monkeypatch.setenv("ORCH_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    ws = Workspace.find()
    store = Store(ws.db_path)
    ids = []
    for started, ended in ((math.inf, None), (math.nan, 1e300), (-1e300, -5.0), (1e12, math.inf)):
        run_id = running(store)
        fields: dict[str, Any] = {"started_at": started, "heartbeat": started, "progress_at": started,
                                  "predicted_at": started}
        if ended is not None:
            transition(store, run_id, Status.SUCCEEDED, "exit code 0", ended_at=ended)
        store.update_run(run_id, **fields)
        ids.append(run_id)
    store.close()
    orch = in_process(capsys)
    for args in (["status"], ["status", "--json"], *(["status", str(i)] for i in ids),
                 *(["status", str(i), "--json"] for i in ids)):
        code, _, err = orch(*args)
        assert code == 0 and "Traceback" not in err, (args, err)
    doc = json.loads(orch("status", str(ids[0]), "--json")[1])
    assert doc["started_at"] is None and doc["duration_s"] is None
    store = Store(ws.db_path)
    documents = [table.page(store, table.RunFilters()), *(pages.run_page(ws, store, i) for i in ids)]
    for document in documents:
        json.loads(JSON(document).body)  # what the dashboard answers: valid JSON, no 500
    store.close()
