"""`orch logs -f` after the tail: a real job on this machine, its log followed from the byte the tail ended at."""

from __future__ import annotations

import time
from pathlib import Path

from orchestrator.store import Store
from orchestrator.watch import follow


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
    run = runflow.start(ws, store, command, spec, local_host(ws.root))
    deadline = time.monotonic() + 20
    while "line 50\n" not in Path(run.paths.log).read_text():  # tail while the job prints
        assert time.monotonic() < deadline
        time.sleep(0.01)
    found = runflow.read_log(ws, store, run.run_id, 5)
    assert found.end is not None and found.text
    assert Path(run.paths.log).read_bytes()[:found.end].endswith(found.text.encode())  # the tail ends there
    time.sleep(0.1)  # lines printed between the tail and the follow are the follow's
    followed: list[bytes] = []
    runflow.follow_log(run, followed.append, sleep=lambda s: time.sleep(0.01), offset=found.end)
    lines = (found.text + b"".join(followed).decode()).splitlines()
    first = int(lines[0].split()[1])
    assert lines == [f"line {i}" for i in range(first, 401)]
    follow.watch(run)
    store.close()
