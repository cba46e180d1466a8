"""Metric summaries (last, and mean and p50 over the steady state) in `orch status ID`, `orch compare`,
`sweep status` and `orch inspect-log`: one function computes them (in process, a real database)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_cli_loop import Orch, orch
from test_objective_first import a_sweep

from orchestrator.config.workspace import Workspace
from orchestrator.store import Store, summaries
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status

__all__ = ["orch"]  # the fixture


def naive(values: list[float]) -> dict[str, float]:
    """The rule written out another way: drop the first tenth (rounded down), then mean and middle."""
    kept = values[len(values) // 10:]
    ordered = sorted(kept)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {"last": values[-1], "mean": sum(kept) / len(kept), "p50": median}


def series(seed: int, n: int) -> list[float]:
    """A server's throughput: a slow warm-up, then noise around a level."""
    rng = random.Random(seed)
    return [round(rng.uniform(1, 5), 2) for _ in range(n // 10)] + [round(rng.gauss(90, 3), 2)
                                                                    for _ in range(n - n // 10)]


@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 37, 200])
def test_the_steady_state_leaves_out_the_first_tenth(n: int) -> None:
    values = series(n, n)
    got = summaries.summarize(values)
    want = naive(values)
    assert got["last"] == want["last"]
    assert got["mean"] == pytest.approx(want["mean"]) and got["p50"] == pytest.approx(want["p50"])
    assert got["samples"] == n and got["steady_samples"] == n - n // 10


def test_warm_up_weighs_on_no_mean() -> None:
    values = series(1, 50)
    got = summaries.summarize(values)
    assert got["mean"] > sum(values) / len(values)  # the warm-up samples pulled the plain mean down
    assert min(values[5:]) <= got["p50"] <= max(values[5:])


def a_run(store: Store, values: dict[str, list[float]], playbook: str = "command") -> int:
    run_id = store.create_run(playbook, "local", {"cmd": "true"})
    for to in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, to)
    for i in range(max(len(v) for v in values.values())):  # interleaved, as a log has them
        store.add_metrics(run_id, [(name, v[i], i) for name, v in values.items() if i < len(v)], ts=1.0 + i)
    transition(store, run_id, Status.SUCCEEDED)
    return run_id


def test_status_shows_each_metrics_summary(orch: Orch, tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    tput, accept = series(2, 40), series(3, 7)
    run_id = a_run(store, {"gen_throughput": tput, "accept_len": accept})
    store.close()
    code, out, _ = orch("status", str(run_id), "--json")
    assert code == 0
    doc = json.loads(out)["metric_summaries"]
    assert list(doc) == ["accept_len", "gen_throughput"]
    for name, values in (("gen_throughput", tput), ("accept_len", accept)):
        want = naive(values)
        assert doc[name]["last"] == want["last"] == json.loads(out)["metrics"][name]
        assert doc[name]["mean"] == pytest.approx(want["mean"]) and doc[name]["p50"] == pytest.approx(want["p50"])
    code, out, _ = orch("status", str(run_id))
    line = next(x for x in out.splitlines() if x.strip().startswith("gen_throughput = "))
    s = doc["gen_throughput"]
    assert f"mean {s['mean']:.4g}, p50 {s['p50']:.4g} of {len(tput) - len(tput) // 10} samples" in line


def test_compare_gives_each_runs_summaries(orch: Orch, tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    before, after = series(4, 30), series(5, 60)
    ids = [a_run(store, {"gen_throughput": before}), a_run(store, {"gen_throughput": after, "extra": [1.0]})]
    store.close()
    code, out, _ = orch("compare", *map(str, ids), "--json")
    assert code == 0
    m = json.loads(out)["metrics"]
    got = m["gen_throughput"]["summaries"]
    for s, values in zip(got, (before, after)):
        assert s["p50"] == pytest.approx(naive(values)["p50"]) and s["last"] == values[-1]
    assert m["extra"]["summaries"][0] is None and m["extra"]["summaries"][1]["last"] == 1.0
    code, out, _ = orch("compare", *map(str, ids))
    rows = out.splitlines()
    row = rows[next(i for i, x in enumerate(rows) if x.startswith("gen_throughput")) + 1]  # the row under it
    assert "mean / p50" in row
    assert f"{got[0]['mean']:.4g} / {got[0]['p50']:.4g}" in row and f"{got[1]['mean']:.4g} / {got[1]['p50']:.4g}" in row


def test_sweep_status_shows_the_objectives_steady_state(orch: Orch, tmp_path: Path) -> None:
    sweep_id = a_sweep(tmp_path)
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    code, out, _ = orch("sweep", "status", str(sweep_id), "--json")
    points = json.loads(out)["points"]
    first = points[0]["run_id"]
    more = series(6, 20)
    store.add_metrics(first, [("gen_throughput", v, None) for v in more], ts=2.0)
    store.close()
    code, out, _ = orch("sweep", "status", str(sweep_id), "--json")
    point = json.loads(out)["points"][0]
    s = point["metric_summaries"]["gen_throughput"]
    values = [points[0]["metrics"]["gen_throughput"], *more]
    assert s["last"] == more[-1] and s["p50"] == pytest.approx(naive(values)["p50"])
    code, out, _ = orch("sweep", "status", str(sweep_id))
    assert code == 0 and "mean / p50" in out
    assert f"{s['mean']:.4g} / {s['p50']:.4g}" in out


def test_inspect_log_summarizes_every_metric_line(orch: Orch, tmp_path: Path) -> None:
    tput, loss = series(7, 25), series(8, 12)
    lines = [f"orch-metric tput={v}" for v in tput] + [f"orch-metric loss={v}" for v in loss]
    log = tmp_path / "job.log"
    log.write_text("starting\n" + "\n".join(lines) + "\ndone\n")
    code, out, _ = orch("inspect-log", str(log), "--json")
    assert code == 0
    doc = json.loads(out)["metric_summaries"]
    for name, values in (("tput", tput), ("loss", loss)):
        want = naive(values)
        assert doc[name]["samples"] == len(values) and doc[name]["last"] == want["last"]
        assert doc[name]["mean"] == pytest.approx(want["mean"]) and doc[name]["p50"] == pytest.approx(want["p50"])
    code, out, _ = orch("inspect-log", str(log))
    assert any(x.strip().startswith("tput = ") and f"p50 {doc['tput']['p50']:.4g}" in x for x in out.splitlines()), out
