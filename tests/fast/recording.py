"""A Watcher that only records, for in-process tests: an injected clock, an executor that reaches no host, a
run already running."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 0.25
        return self.now


class FakeExecutor:
    """What a Watcher asks of its executor while it only records (nothing here reaches a host)."""

    transport = None
    schedules_gpus = False
    processes = False

    def __init__(self) -> None:
        self.kills = 0

    def kill(self, handle: Any, grace_s: float) -> str:
        self.kills += 1
        return "gone"

    def explain_loss(self, paths: Any, handle: Any) -> str:
        return "gone"


def new_run(store: Store, tmp: Path, cmd: str = "true") -> int:
    """A `command` run on `local`, running as pid 4242 since 999000."""
    run_id = store.create_run("command", "local", {"cmd": cmd})
    for status in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, status)
    store.update_run(run_id, remote_dir=str(tmp / f"r{run_id}"))
    transition(store, run_id, Status.RUNNING, pid=4242, pid_start="1", started_at=999_000.0)
    return run_id
