"""A sweep that searches, run in process on this machine: a made-up response surface (tests/jobs/surface_job.py),
Optuna proposing its points, losers pruned from their live samples, crashes and a latency bound learnt from."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

from orchtest import Orch, kill_controller

from orchestrator import sweep
from orchestrator.config.workspace import Workspace
from orchestrator.store import Store
from orchestrator.ui.pages import sweep_page
from orchestrator.ui.report import sweep_report

JOBS = Path(__file__).parent / "jobs"
sys.path.insert(0, str(JOBS))
import surface_job

# Seed 1 of the file (every seed's sequence of proposals is fixed by the records it learns from): the same
# search over this surface, run in process without pruning, found a point within 4 % of the true best with
# 98 of seeds 0-99, wasting 2.7 trials on average (5 at most) in the crashing region.
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
    # losers stopped early: pruned at a sample before their last, their runs cancelled (never ended by
    # themselves) through the ordinary stop; the job may print a sample or two more before the stop lands
    store = Store(ws.db_path)
    pruned = [p for p in points if p["status"] == "pruned"]
    assert pruned, states
    for p in pruned:
        run = store.get_run(p["run_id"])
        at = re.match(r"pruned at sample (\d+): ", run.reason or "")
        assert run.status.value == "cancelled" and at and int(at.group(1)) < surface_job.SAMPLES, run.reason
        assert store.count_samples(run.id, "throughput") >= int(at.group(1))
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
    # the dashboard's page and the report show the same findings, the best marked where the bounds hold
    page = sweep_page(store, doc["id"])
    assert page["best"]["throughput"] == best["index"] and page["search_lines"] == sweep.search_lines(doc)
    html = sweep_report(store, doc["id"], tmp_path / "report").read_text()
    assert "search: 20 of 20 trials done" in html and "search.png" in html and "Pareto front" in html
    assert (tmp_path / "report" / "search.png").exists()
    runs = len(sweep.events(store, doc["id"]))
    n_runs = store.newest_run_id()
    # the same file again: the study is rebuilt from the records; nothing is run again
    again = sweep.run(ws, path, echo=lines.append)
    assert again["id"] == doc["id"] and store.newest_run_id() == n_runs
    assert [(p["status"], p["run_id"]) for p in again["points"]] == [(p["status"], p["run_id"]) for p in points]
    assert again["best"] == best and len(sweep.events(store, doc["id"])) > runs
    assert f"sweep {doc['id']} (surface): a search of 20 trials on local, 20 already done" in lines
    store.close()


def test_two_hosts_search_at_once_and_a_killed_controller_resumes_without_rerunning(tmp_path, ssh_fleet) -> None:
    overrides = {f"test{i}": {"workdir": str(tmp_path / f"remote{i}")} for i in (1, 2)}
    orch = Orch(tmp_path / "ws", ssh_fleet.hosts_toml(**overrides))
    gate = tmp_path / "gate"
    body = FILE.replace('hosts = ["local"]', 'hosts = ["test1", "test2"]').replace("trials = 20", "trials = 6")
    body = body.replace('env = { PACE = "0.15" }', f'env = {{ PACE = "0.05", GATE = {json.dumps(str(gate))} }}')
    path = orch.root / "s.toml"
    path.write_text(body.replace("seed = 1", 'seed = 2\npruner = "none"'))
    proc = orch.spawn("sweep", "run", str(path))
    # every job holds before its last sample: both hosts are seen running a trial at the same time
    deadline = time.time() + 60
    while time.time() < deadline:
        rows = _runs(orch)
        running = [r for r in rows if r["status"] == "running"]
        if {r["host"] for r in running} == {"test1", "test2"}:
            break
        time.sleep(0.05)
    assert {r["host"] for r in running} == {"test1", "test2"}, rows
    kill_controller(proc)
    before = {r["id"]: r for r in _runs(orch)}
    assert json.loads(orch("sweep", "status", "surface", "--json", check=0).stdout)["status"] == "interrupted"
    gate.touch()
    res = orch("sweep", "run", str(path), timeout=120)
    assert res.returncode == 0, res.stderr
    rows = _runs(orch)
    doc = json.loads(orch("sweep", "status", "surface", "--json", check=0).stdout)
    assert len(doc["points"]) == 6 and {p["status"] for p in doc["points"]} <= {"succeeded", "failed", "infeasible"}
    assert doc["best"] is not None and all({"point", "status", "objective"} <= p.keys() for p in doc["points"])
    # a trial whose run launched before the controller died ran once: watched to its end, never again
    launched = {json.dumps(r["point"], sort_keys=True) for r in before.values() if r["status"] == "running"}
    per_point = {}
    for r in rows:
        per_point.setdefault(json.dumps(r["point"], sort_keys=True), []).append(r)
    for key in launched:
        (only,) = per_point[key]
        assert only["status"] == "succeeded"
    assert all(len(rs) == 1 or any("controller died" in (r["reason"] or "") for r in rs) for rs in per_point.values())
    assert {r["host"] for r in rows} == {"test1", "test2"}


def _runs(orch: Orch) -> list[dict]:
    res = orch("status", "--json", "--limit", "1000")
    return sorted(json.loads(res.stdout), key=lambda r: r["id"]) if res.returncode == 0 else []


def test_warm_start_begins_from_earlier_sweeps_of_the_same_playbook_and_model(tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    fast = FILE.replace('env = { PACE = "0.15" }', 'env = { PACE = "0.01" }').replace('seed = 1', 'seed = 1\npruner = "none"')
    first = tmp_path / "first.toml"
    first.write_text(fast.replace("trials = 20", "trials = 3"))
    done = sweep.run(ws, first)
    told = [p for p in done["points"] if p["status"] in ("succeeded", "infeasible", "failed")]
    assert len(told) == 3
    later = tmp_path / "later.toml"
    later.write_text(fast.replace('name = "surface"', 'name = "later"').replace("trials = 20", "trials = 1")
                     .replace("seed = 1", "seed = 1\nwarm_start = true"))
    lines: list[str] = []
    doc = sweep.run(ws, later, echo=lines.append)
    assert "warm start: 3 point(s) of earlier sweeps" in lines and len(doc["points"]) == 1
    # another model is another receipt: nothing to start from
    other = tmp_path / "other.toml"
    other.write_text(later.read_text().replace('name = "later"', 'name = "other"').replace(
        "[spec]\n", '[spec]\nengine = "sglang"\n'))
    lines.clear()
    sweep.run(ws, other, echo=lines.append)
    assert not any(line.startswith("warm start") for line in lines)


def test_a_cancelled_search_proposes_nothing_more_and_running_the_file_again_goes_on(tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    gate = tmp_path / "gate"
    path = tmp_path / "s.toml"
    path.write_text(FILE.replace("trials = 20", "trials = 4").replace(
        'env = { PACE = "0.15" }', f'env = {{ PACE = "0.01", GATE = {json.dumps(str(gate))} }}'))
    ended: list[dict] = []
    controller = threading.Thread(target=lambda: ended.append(sweep.run(ws, path)), daemon=True)
    controller.start()
    store = Store(ws.db_path)
    deadline = time.time() + 60
    while not store_running(store) and time.time() < deadline:
        time.sleep(0.05)
    sweep.cancel(ws, "surface", grace_s=1)
    controller.join(60)
    assert ended and ended[0]["status"] == "cancelled"
    assert [p["status"] for p in ended[0]["points"]] == ["cancelled"]  # no new proposal after the cancel
    gate.touch()
    again = sweep.run(ws, path)
    assert len(again["points"]) == 4 and again["points"][0]["runs"] == 2  # the cancelled one ran again
    assert all(p["status"] != "cancelled" for p in again["points"])
    store.close()


def store_running(store: Store) -> bool:
    return any(r.status.value == "running" for r in store.list_runs(limit=10))


def test_stages_search_later_keys_with_the_best_of_the_earlier_fixed(tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    path = tmp_path / "s.toml"
    path.write_text(FILE.replace('env = { PACE = "0.15" }', 'env = { PACE = "0.01", KIND = "b", Y = "2" }')
                    .replace('"env.KIND" = { choices = ["a", "b", "c"] }\n', "")
                    .replace('"env.Y" = { low = 1, high = 64, log = true }\n', "")
                    .replace("trials = 20", 'trials = 3\npruner = "none"')
                    .replace("[constraints]", '[[search.stages]]\ntrials = 2\n"env.Y" = { low = 1, high = 8 }\n'
                                               "[constraints]"))
    lines: list[str] = []
    doc = sweep.run(ws, path, echo=lines.append)
    base, later = doc["points"][:3], doc["points"][3:]
    assert [p["stage"] for p in doc["points"]] == [0, 0, 0, 1, 1] and doc["search"]["trials"] == 5
    assert all(set(p["point"]) == {"env.X"} for p in base)
    ran = [p for p in base if p["status"] == "succeeded"]
    best_x = max(ran, key=lambda p: p["objective"])["point"]["env.X"]
    # the second stage searches Y with the first stage's best X fixed in each of its points
    assert all(p["point"]["env.X"] == best_x and set(p["point"]) == {"env.X", "env.Y"} for p in later), later
    assert any(line.startswith("stage 1: env.Y with env.X=") for line in lines), lines
