"""`orch compare`: runs and metrics recorded in a real Store, compared by the library and the real CLI."""

from __future__ import annotations

import json

import pytest
from orchtest import Orch

from orchestrator.errors import NotFound, UsageError
from orchestrator.store import Store
from orchestrator.ui.report import compare, flatten

BASE = {"cmd": "python -m sglang.launch_server --model-path /m", "env": {"NCCL_DEBUG": "WARN"},
        "patches": [], "poll_min": None, "speculative_num_steps": 3}


def record(store: Store, spec: dict, metrics: dict[str, list[float]], playbook: str = "command") -> int:
    run_id = store.create_run(playbook, "gpu01", spec)
    for name, values in metrics.items():
        store.add_metrics(run_id, [(name, v, i) for i, v in enumerate(values)], 1000.0)
    return run_id


def three_runs(store: Store) -> list[int]:
    return [
        record(store, BASE, {"gen_throughput": [80.0, 88.8], "accept_rate": [0.19], "accept_len": [1.7]}),
        record(store, {**BASE, "speculative_num_steps": 5, "env": {"NCCL_DEBUG": "INFO"}},
               {"gen_throughput": [94.0], "accept_rate": [0.47], "accept_len": [2.9]}),
        record(store, {**BASE, "patches": ["sglang-eagle3-hidden-debug"]},
               {"gen_throughput": [0.0], "load_weight_s": [245.3]}),
    ]


def test_differences_and_ratios(tmp_path):
    store = Store(tmp_path / "orch.db")
    ids = three_runs(store)
    got = compare(store, ids)
    assert got["runs"] == ids
    assert got["spec"] == {
        "env.NCCL_DEBUG": ["WARN", "INFO", "WARN"],
        "patches": [[], [], ["sglang-eagle3-hidden-debug"]],
        "speculative_num_steps": [3, 5, 3],
    }
    m = got["metrics"]
    assert list(m) == ["accept_len", "accept_rate", "gen_throughput", "load_weight_s"]
    # each run's summary of its whole series: two samples, none left out as warm-up
    tput = m["gen_throughput"].pop("summaries")
    assert [s["last"] for s in tput] == [88.8, 94.0, 0.0] and tput[0]["steady_samples"] == 2
    assert tput[0]["mean"] == pytest.approx((80.0 + 88.8) / 2) == tput[0]["p50"]
    assert [s is None for s in m["accept_rate"].pop("summaries")] == [False, False, True]
    assert [s is None for s in m["load_weight_s"].pop("summaries")] == [True, True, False]
    # the latest value of each series counts (the keys of the verdicts are tested on their own)
    m = {name: {k: e[k] for k in ("values", "ratios", "lower_is_better", "better")} for name, e in m.items()}
    assert m["gen_throughput"] == {"values": [88.8, 94.0, 0.0], "ratios": [1.0, 1.0586, 0.0],
                                   "lower_is_better": False, "better": [None, True, False]}
    assert m["accept_rate"] == {"values": [0.19, 0.47, None], "ratios": [1.0, 2.4737, None],
                                "lower_is_better": False, "better": [None, True, None]}
    # no ratio against a run that lacks the metric; a load time is better lower
    assert m["load_weight_s"] == {"values": [None, None, 245.3], "ratios": [None, None, None],
                                  "lower_is_better": True, "better": [None, None, None]}


def test_all_keys_and_order_given(tmp_path):
    store = Store(tmp_path / "orch.db")
    a, _, c = three_runs(store)
    got = compare(store, [c, a], all_keys=True)
    assert got["runs"] == [c, a]
    assert got["spec"]["cmd"] == [BASE["cmd"]] * 2 and got["spec"]["poll_min"] == [None, None]
    assert set(got["spec"]) == {"cmd", "env.NCCL_DEBUG", "patches", "poll_min", "speculative_num_steps"}
    # ratios against a first value of 0 are undefined, not infinite
    assert got["metrics"]["gen_throughput"]["values"] == [0.0, 88.8]
    assert got["metrics"]["gen_throughput"]["ratios"] == [None, None]
    assert got["metrics"]["load_weight_s"]["ratios"] == [1.0, None]


def test_keys_missing_from_one_spec(tmp_path):
    store = Store(tmp_path / "orch.db")
    a = record(store, {"model": "/m", "layers": [2, 30, 58]}, {}, playbook="extract-hidden-states")
    b = record(store, {"model": "/m", "layers": [2, 30, 58], "backend": "speculators", "env": {}}, {},
               playbook="extract-hidden-states")
    got = compare(store, [a, b])
    assert got["spec"] == {"backend": [None, "speculators"], "env": [None, {}]}
    assert got["metrics"] == {}
    assert flatten({"env": {"A": "1", "B": {"C": 2}}, "x": 1}) == {"env.A": "1", "env.B.C": 2, "x": 1}


def test_bad_ids(tmp_path):
    store = Store(tmp_path / "orch.db")
    a, _, _ = three_runs(store)
    with pytest.raises(NotFound, match="no run 99"):
        compare(store, [a, 99])
    with pytest.raises(UsageError, match="at least two"):
        compare(store, [a])


def test_cli(tmp_path):
    orch = Orch(tmp_path / "ws")
    store = Store(orch.db)
    ids = three_runs(store)
    store.close()
    got = json.loads(orch("compare", *map(str, ids), "--json", check=0).stdout)
    assert got["runs"] == ids and list(got) == ["runs", "baseline", "differences", "invalid", "spec", "metrics"] and got["baseline"] == ids[0]
    assert got["metrics"]["gen_throughput"]["ratios"] == [1.0, 1.0586, 0.0]
    assert "cmd" not in got["spec"]
    assert "cmd" in json.loads(orch("compare", *map(str, ids), "--json", "--all", check=0).stdout)["spec"]
    table = orch("compare", str(ids[0]), str(ids[1]), check=0).stdout
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines() if line.strip()}
    assert rows["run"] == [str(ids[0]), "run", str(ids[1])]
    # one or two samples a run: too few to know their spread, so no verdict either way
    assert rows["gen_throughput"] == ["88.8", "94", "(1.06x)", "incomparable"]
    assert rows["accept_rate"] == ["0.19", "0.47", "(2.47x)", "incomparable"]
    assert rows["speculative_num_steps"] == ["3", "5"]


def test_cli_baseline(tmp_path):
    orch = Orch(tmp_path / "ws")
    store = Store(orch.db)
    a, b, c = three_runs(store)
    store.close()
    # the baseline comes first whatever the order given, and every other run is measured against it
    got = json.loads(orch("compare", str(b), str(c), "--baseline", str(a), "--json", check=0).stdout)
    assert got["runs"] == [a, b, c] and got["baseline"] == a
    assert got["metrics"]["gen_throughput"]["ratios"] == [1.0, 1.0586, 0.0]
    table = orch("compare", str(b), "--baseline", str(a), check=0).stdout
    rows = {cells[0]: cells[1:] for cells in (line.split("\t") for line in table.splitlines())}  # piped: tabs
    assert rows[""] == [f"run {a} (baseline)", f"run {b}"]
    assert rows["gen_throughput"][1] == "88.8 → 94 (1.06x) incomparable"
    assert rows["accept_rate"][1] == "0.19 → 0.47 (2.47x) incomparable"
    res = orch("compare", str(b), "--baseline", "x")
    assert res.returncode == 2 and res.stderr.strip() == "orch: not a run id: 'x'"


@pytest.mark.parametrize("args, message", [
    (["1", "99"], "orch: no run 99"),
    (["1", "x"], "orch: not a run id: 'x'"),
    (["1"], "orch: compare needs at least two runs"),
])
def test_cli_bad_input(tmp_path, args, message):
    orch = Orch(tmp_path / "ws")
    store = Store(orch.db)
    three_runs(store)
    store.close()
    res = orch("compare", *args)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [message]
