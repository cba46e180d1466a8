"""A sweep that searches, run in process on this machine: a made-up response surface (tests/jobs/surface_job.py),
Optuna proposing its points, losers pruned from their live samples, crashes and a latency bound learnt from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from orchestrator import sweep
from orchestrator.config.workspace import Workspace
from orchestrator.store import Store

JOBS = Path(__file__).parent / "jobs"
sys.path.insert(0, str(JOBS))
import surface_job  # noqa: E402

# Seed 1 of the file: the surface's search with this seed was checked over 200 seeds (every seed's sequence
# of proposals is fixed by the records it learns from): 199 found a point within 4 % of the true best.
FILE = f"""name = "surface"
playbook = "command"
hosts = ["local"]
objective = {{ metric = "throughput", goal = "max" }}
[spec]
cmd = {json.dumps(f"{sys.executable} {JOBS / 'surface_job.py'}")}
poll_min = 0.05
poll_max = 0.3
env = {{ PACE = "0.15" }}
[search]
trials = 20
seed = 1
"env.X" = {{ low = 0.0, high = 10.0 }}
"env.Y" = {{ low = 1, high = 64, log = true }}
"env.KIND" = {{ choices = ["a", "b", "c"] }}
[constraints]
p99_latency_ms = {{ max = {surface_job.LATENCY_MAX} }}
"""


def test_search_finds_the_best_prunes_losers_and_learns_from_crashes_then_resumes(tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    path = tmp_path / "s.toml"
    path.write_text(FILE)
    lines: list[str] = []
    doc = sweep.run(ws, path, echo=lines.append)
    assert doc["status"] == "succeeded", lines
    points = doc["points"]
    assert len(points) == 20 and all(p["runs"] <= 1 for p in points)
    states = [p["status"] for p in points]
    assert set(states) <= {"succeeded", "pruned", "failed", "infeasible"}, states
    # within 4 % of the true best, which keeps the latency bound and does not crash
    true_best, _ = surface_job.true_best()
    best = doc["best"]
    assert best["value"] >= 0.96 * true_best, (best, true_best)
    winner = next(p for p in points if p["index"] == best["index"])
    assert winner["status"] == "succeeded" and winner["metrics"]["p99_latency_ms"] <= surface_job.LATENCY_MAX
    env = {k.removeprefix("env."): v for k, v in winner["point"].items()}
    assert abs(surface_job.throughput(env["X"], env["Y"], env["KIND"]) - best["value"]) < 1e-3
    # losers stopped early: their runs cancelled before their last sample, through the ordinary stop
    store = Store(ws.db_path)
    pruned = [p for p in points if p["status"] == "pruned"]
    assert pruned, states
    for p in pruned:
        run = store.get_run(p["run_id"])
        assert run.status.value == "cancelled" and (run.reason or "").startswith("pruned at sample")
        assert store.count_samples(run.id, "throughput") < surface_job.SAMPLES
        assert p["objective"] is not None  # the value it had
    # crashes: failed with their cause, a few at most; a point above the bound is infeasible, never the best
    crashed = [p for p in points if p["status"] == "failed"]
    assert all(p["cause"] == "out of memory" for p in crashed) and len(crashed) <= 6, crashed
    for p in crashed:
        e = {k.removeprefix("env."): v for k, v in p["point"].items()}
        assert surface_job.crashes(e["X"], e["Y"])
    for p in points:
        if p["status"] == "infeasible":
            assert p["metrics"]["p99_latency_ms"] > surface_job.LATENCY_MAX and "infeasible" in p["reason"]
    found = doc["search"]
    assert found["trials"] == 20 and found["done"] == 20
    assert sum(found["trial_states"].values()) == 20 and found["trial_states"].get("pruned") == len(pruned)
    assert [h["index"] for h in found["history"]] == list(range(20))
    assert found["history"][-1]["best"] == best["value"]
    assert found["pareto"]["metric"] == "p99_latency_ms" and found["pareto"]["points"]
    assert set(found["importance"]) == {"env.X", "env.Y", "env.KIND"}
    assert found["best_receipt"]["run_id"] == best["run_id"]
    runs = len(sweep.events(store, doc["id"]))
    n_runs = store.newest_run_id()
    # the same file again: the study is rebuilt from the records; nothing is run again
    again = sweep.run(ws, path, echo=lines.append)
    assert again["id"] == doc["id"] and store.newest_run_id() == n_runs
    assert [(p["status"], p["run_id"]) for p in again["points"]] == [(p["status"], p["run_id"]) for p in points]
    assert again["best"] == best and len(sweep.events(store, doc["id"])) > runs
    assert f"sweep {doc['id']} (surface): a search of 20 trials on local, 20 already done" in lines
    store.close()
