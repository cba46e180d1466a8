"""The CLI of the daily loop, in process: what a person reads when a host is busy, and the like."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from orchtest import in_process

from orchestrator.store import Store, lease
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
    run_id = lease.acquire(store, "local", None, lambda: store.create_run("serve-eagle3", "local", {}), 30.0)
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


def test_following_a_log_goes_on_from_the_byte_its_tail_ended_at(tmp_path: Path) -> None:
    """A job printing a line every few ms on this machine: the tail and what follows it are the log's
    lines to its end, none twice and none left out."""
    from orchestrator import runflow
    from orchestrator.config.hosts import local_host
    from orchestrator.config.workspace import Workspace
    from orchestrator.runflow import registry

    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    command = registry.playbook("command")
    spec = command.Spec(cmd="sleep 0.3; for i in $(seq 1 400); do echo line $i; sleep 0.002; done",
                        poll_min=0.05, poll_max=0.2)
    ctx = runflow.start(ws, store, command, spec, local_host(ws.root))
    deadline = time.monotonic() + 20
    while "line 50\n" not in Path(ctx.paths.log).read_text():  # tail while the job prints
        assert time.monotonic() < deadline
        time.sleep(0.01)
    found = runflow.read_log(ws, store, ctx.run_id, 5)
    assert found.end is not None and found.text
    assert Path(ctx.paths.log).read_bytes()[:found.end].endswith(found.text.encode())  # the tail ends there
    time.sleep(0.1)  # lines printed between the tail and the follow are the follow's
    followed: list[bytes] = []
    runflow.follow_log(ctx, followed.append, sleep=lambda s: time.sleep(0.01), offset=found.end)
    lines = (found.text + b"".join(followed).decode()).splitlines()
    first = int(lines[0].split()[1])
    assert lines == [f"line {i}" for i in range(first, 401)]
    runflow.watch(ctx)
    store.close()
