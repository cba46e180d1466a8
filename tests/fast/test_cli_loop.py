"""The CLI of the daily loop, in process: what a person reads when a host is busy, and the like."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from hostdirs import HostDirs
from orchtest import in_process

from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status

Orch = Callable[..., tuple[int, str, str]]


@pytest.fixture
def orch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Orch:
    """`orch ARGS` in a workspace of the test's own: (exit code, stdout, stderr)."""
    monkeypatch.setenv("ORCH_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    (tmp_path / "hosts.toml").write_text("")

    return in_process(capsys)


def hold_local_host(tmp_path: Path) -> int:
    """A run of this process holding the local host, running (as a server would)."""
    store = Store(tmp_path / "runs" / "orch.db")
    [run_id] = HostDirs(tmp_path, store, local=True).acquire(["local"], lambda: [store.create_run("serve-eagle3", "local", {})])
    for status in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, status)
    store.update_run(run_id, phase="ready")
    store.close()
    return run_id


def test_a_busy_host_names_the_run_and_both_ways_on(orch: Orch, tmp_path: Path) -> None:
    held = hold_local_host(tmp_path)
    code, _, err = orch("run", "command", "--set", "cmd=true")
    assert code == 1
    assert err.startswith(f"orch: host local is busy with run {held} (serve-eagle3, running (ready) for ")
    assert "--queue waits for it to end, --replace stops it first" in err
    assert "pid" not in err  # the run, not the process that happened to take the lease
    assert len(Store(tmp_path / "runs" / "orch.db").list_runs()) == 1  # refused: no run was created
