"""The objective first: every metric's direction, the sweep's best by its objective in `sweep status`, the
dashboard's sweep page and compare (in process, a real database)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_loop import Orch, orch

from orchestrator import sweep
from orchestrator.config.objective import lower_is_better
from orchestrator.config.workspace import Workspace
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.sweep import db as sweep_db
from orchestrator.sweep.record import PointStatus
from orchestrator.ui import pages, report

__all__ = ["orch"]  # the fixture

# (gen_throughput, accept_len, load_weight_s) per point: each metric has another best point
POINTS = [(80.0, 3.1, 20.0), (95.5, 2.9, 30.0), (88.8, 3.3, 10.0)]


@pytest.mark.parametrize("name, lower", [
    ("gen_throughput", False), ("output_throughput", False), ("tokens_per_s", False), ("accept_len", False),
    ("accept_rate", False), ("samples", False), ("load_weight_s", True), ("median_ttft_ms", True),
    ("median_itl_ms", True), ("e2e_latency", True), ("train/loss", True),
])
def test_every_metric_has_a_direction(name: str, lower: bool) -> None:
    assert lower_is_better(name) is lower


def a_sweep(root: Path, objective: str = '{ metric = "gen_throughput", goal = "max" }') -> int:
    """A sweep of three succeeded points on the local host, recorded as its controller would."""
    ws = Workspace(root=root, hosts_file=root / "hosts.toml")
    store = Store(ws.db_path)
    (root / "s.toml").write_text(f'name = "tput"\nplaybook = "command"\nhosts = ["local"]\nobjective = {objective}\n'
                                 '[spec]\ncmd = "true"\n[matrix]\n"env.B" = ["4", "8", "16"]\n')
    sweep_id = sweep_db.register(store, sweep.plan(ws, store, root / "s.toml"))
    for pt, (tput, accept, load) in zip(sweep_db.points(store, sweep_id), POINTS):
        run_id = store.create_run("command", "local", {"cmd": "true", "env": {"B": pt.diff["env.B"]}})
        store.update_run(run_id, sweep_id=sweep_id, point=pt.key)
        for to in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING, Status.SUCCEEDED):
            transition(store, run_id, to)
        store.add_metrics(run_id, [("gen_throughput", tput, None), ("accept_len", accept, None),
                                   ("load_weight_s", load, None)], ts=1.0)
        assert sweep_db.start_point(store, sweep_id, pt.index)
        sweep_db.settle_point(store, sweep_id, pt.index, PointStatus.SUCCEEDED, run_id=run_id)
    store.close()
    return sweep_id


def test_sweep_status_shows_the_objective_per_point_and_the_best(orch: Orch, tmp_path: Path) -> None:
    sweep_id = a_sweep(tmp_path)
    code, out, _ = orch("sweep", "status", str(sweep_id))
    assert code == 0
    lines = out.splitlines()
    header = lines[1].split("\t")
    assert header[:7] == ["#", "point", "host", "status", "run", "tries", "gen_throughput"]
    rows = [line.split("\t") for line in lines[2:5]]
    assert [r[6] for r in rows] == ["80", "95.5", "88.8"]
    assert [r[0] for r in rows] == ["0", "1 *", "2"]
    assert lines[5] == "best: #1 env.B=8 (run 2): gen_throughput=95.5 (higher is better)"


def test_a_declared_goal_and_a_latency_pick_their_own_best(orch: Orch, tmp_path: Path) -> None:
    sweep_id = a_sweep(tmp_path, '{ metric = "load_weight_s", goal = "min" }')
    store = Store(tmp_path / "runs" / "orch.db")
    doc = sweep.document(store, sweep_id)
    assert doc["best"]["index"] == 2 and [p["objective"] for p in doc["points"]] == [20.0, 30.0, 10.0]
    assert sweep.best_line(doc) == "best: #2 env.B=16 (run 3): load_weight_s=10 (lower is better)"


def test_the_dashboards_sweep_page_opens_on_the_objective(tmp_path: Path) -> None:
    sweep_id = a_sweep(tmp_path)
    store = Store(tmp_path / "runs" / "orch.db")
    page = pages.sweep_page(store, sweep_id)
    assert page["objective"] == "gen_throughput"  # not the alphabetically first metric
    assert page["metrics"] == ["gen_throughput", "accept_len", "load_weight_s"]
    # each metric's best in its own direction: the shortest load, not the longest
    assert page["best"] == {"gen_throughput": 1, "accept_len": 2, "load_weight_s": 2}
    assert page["lower_is_better"] == {"gen_throughput": False, "accept_len": False, "load_weight_s": True}
    assert pages.sweep_page(store, sweep_id, "accept_len")["objective"] == "accept_len"  # the page's choice


def test_compare_says_which_way_is_better(tmp_path: Path) -> None:
    a_sweep(tmp_path)
    store = Store(tmp_path / "runs" / "orch.db")
    got = report.compare(store, [1, 2])
    assert got["metrics"]["gen_throughput"]["better"] == [None, True]  # 95.5 over 80: better
    assert got["metrics"]["load_weight_s"]["better"] == [None, False]  # 30 s of loading over 20 s: worse
    assert got["metrics"]["load_weight_s"]["lower_is_better"] is True


def test_compare_on_a_terminal_colours_better_green_and_worse_red(orch: Orch, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from rich.console import Console

    from orchestrator.cli import inspect, render

    a_sweep(tmp_path)
    # each run measured four times, within 1 %: the differences lie beyond the spread of both
    store = Store(Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml").db_path)
    for run_id, values in ((1, POINTS[0]), (2, POINTS[1])):
        store.add_metrics(run_id, [(name, v * f, None) for f in (0.99, 1.01, 1.0)
                                   for name, v in zip(("gen_throughput", "accept_len", "load_weight_s"), values)], 2.0)
    store.close()
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, color_system="standard", width=200, highlight=False,
                      markup=False)
    for module in (render, inspect):  # (each module's own name for it: a module imported now keeps what it finds)
        monkeypatch.setattr(module, "out", console)
    code, _, _ = orch("compare", "1", "2")
    assert code == 0
    lines = {line.split()[0]: line for line in screen.getvalue().splitlines() if line.strip()}
    green, red = "\x1b[32m", "\x1b[31m"
    assert green + "95.5 (1.19x) better" in lines["gen_throughput"]  # more throughput: better
    assert red + "30 (1.50x) worse" in lines["load_weight_s"]  # a longer load: worse, though the number grew
    assert red + "2.9 (0.94x) worse" in lines["accept_len"]
