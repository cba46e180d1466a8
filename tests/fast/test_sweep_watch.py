"""Following a sweep from its record, in process: each reading is the real database as a controller leaves
it, moved on by an injected sleep."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator import sweep
from orchestrator.config.workspace import Workspace
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.sweep import db as sweep_db
from orchestrator.sweep.record import PointStatus, SweepStatus


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "runs" / "orch.db")


def a_sweep(root: Path, store: Store) -> int:
    ws = Workspace(root=root, hosts_file=root / "hosts.toml")
    (root / "s.toml").write_text('name = "tput"\nplaybook = "command"\nhosts = ["local"]\n'
                                 'objective = { metric = "gen_throughput", goal = "max" }\n'
                                 '[spec]\ncmd = "true"\n[matrix]\n"env.B" = ["4", "8"]\n')
    sweep_id = sweep_db.register(store, sweep.plan(ws, store, root / "s.toml"))
    sweep_db.claim(store, sweep_id)  # this process is its controller
    return sweep_id


def start(store: Store, sweep_id: int, index: int) -> int:
    run_id = store.create_run("command", "local", {"cmd": "true"})
    store.update_run(run_id, sweep_id=sweep_id)
    for to in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, to)
    sweep_db.start_point(store, sweep_id, index)
    sweep_db.attach_run(store, sweep_id, index, run_id)
    return run_id


def succeed(store: Store, sweep_id: int, index: int, run_id: int, tput: float) -> None:
    store.add_metrics(run_id, [("gen_throughput", tput, None)], ts=1.0)
    transition(store, run_id, Status.SUCCEEDED)
    sweep_db.settle_point(store, sweep_id, index, PointStatus.SUCCEEDED, run_id=run_id)


def test_a_follower_sees_each_point_its_phase_and_last_line_until_the_sweep_ends(
    tmp_path: Path, store: Store
) -> None:
    sweep_id = a_sweep(tmp_path, store)
    runs: dict[int, int] = {}
    steps: list[Callable[[], None]] = [
        lambda: runs.update({0: start(store, sweep_id, 0)}),
        lambda: store.update_run(runs[0], phase="loading", last_line="Loading weights 3/64"),
        lambda: store.update_run(runs[0], last_line="Loading weights 9/64"),  # no news for a change line
        lambda: succeed(store, sweep_id, 0, runs[0], 88.8),
        lambda: runs.update({1: start(store, sweep_id, 1)}),
        lambda: store.update_run(runs[1], phase="starting", last_line="step 1",
                                 parser_state={"engine": None, "lines": 1}),
        lambda: succeed(store, sweep_id, 1, runs[1], 95.5),
        lambda: sweep_db.transition_sweep(store, sweep_id, SweepStatus.SUCCEEDED),
    ]
    lines: list[str] = []
    last: list[dict] = []

    def on_doc(doc: dict) -> None:
        lines.extend(sweep.changes(last[-1] if last else None, doc))
        last.append(doc)

    final = sweep.follow(store, sweep_id, on_doc, sleep=lambda s: steps.pop(0)())
    assert not steps and final["status"] == "succeeded"
    a, b = runs[0], runs[1]
    assert lines == [
        f"sweep {sweep_id} (tput): running; 2 points: 2 queued",
        f"#0 env.B=4 on local: running, run {a} (starting)",
        f"#0 env.B=4 on local: running, run {a} (loading) · Loading weights 3/64",
        f"#0 env.B=4 on local: succeeded, run {a}, gen_throughput=88.8",
        f"#1 env.B=8 on local: running, run {b} (starting)",
        f"#1 env.B=8 on local: running, run {b} (running) · step 1",  # a plain job that printed
        f"#1 env.B=8 on local: succeeded, run {b}, gen_throughput=95.5",
        f"sweep {sweep_id} (tput): succeeded",
    ]
    assert sweep.best_line(final) == f"best: #1 env.B=8 (run {b}): gen_throughput=95.5 (higher is better)"


def test_a_sweep_whose_controller_died_ends_the_follow(tmp_path: Path, store: Store) -> None:
    sweep_id = a_sweep(tmp_path, store)
    gone = f"{socket.gethostname()}:{2**22 + 1}:1"  # above the kernel's pid limit: no such process here
    store.conn.execute("UPDATE sweeps SET controller = ? WHERE id = ?", (gone, sweep_id))
    store.conn.commit()
    readings: list[dict] = []
    final = sweep.follow(store, sweep_id, readings.append, sleep=lambda s: pytest.fail("no second reading"))
    assert final["status"] == "interrupted" and len(readings) == 1
