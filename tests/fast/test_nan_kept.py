"""A NaN or an infinity read from a log is kept as what it is: stored (SQLite's REAL turns a NaN into NULL,
so the store keeps it as text), shown (`nan`, `inf`) and given in strict JSON ("NaN", "Infinity"); a tensor
that was None stays `-`. The EAGLE-3 debug table, which hunts exactly these, in process."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import pytest

from orchestrator.config.objective import Objective, best
from orchestrator.logparse import LogParser
from orchestrator.store import Store, runtables
from orchestrator.store.encoding import json_safe
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from playbooks.eagle3_debug import parse

Orch = Callable[..., tuple[int, str, str]]
HOSTS = ""
LINE = "[orch-eagle3-debug] {stage} call=1 part=1/1 shape=(7, 48) dtype=torch.float16 absmean={value} sample=[]"


@pytest.fixture
def orch(records_orch: Orch) -> Orch:
    return records_orch


def test_nan_and_inf_in_the_debug_table_are_kept(orch: Orch, records_store: Store) -> None:
    store = records_store
    run_id = store.create_run("serve-eagle3", "local", {})
    for s in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, s)
    rows = [parse(LINE.format(stage=stage, value=value))
            for stage, value in (("embed", "0.5"), ("hidden", "nan"), ("logits", "inf"), ("norm", "-inf"))]
    rows.append(parse("[orch-eagle3-debug] aux call=1 part=1/1 None"))
    store.add_rows(run_id, [("eagle3_debug", r) for r in rows if r is not None], time.time(), runtables.installed())
    stored = dict(store.conn.execute("SELECT stage, absmean FROM eagle3_debug WHERE run_id = ?", (run_id,)))
    assert stored["hidden"] is not None and stored["logits"] == math.inf and stored["aux"] is None
    doc = json.loads(orch("status", str(run_id), "--json")[1])
    absmean = {r["stage"]: r["absmean"] for r in doc["eagle3_debug"]}
    assert absmean == {"embed": 0.5, "hidden": "NaN", "logits": "Infinity", "norm": "-Infinity", "aux": None}
    shown = {line.split()[0]: line.split() for line in orch("status", str(run_id))[1].splitlines()
             if line.split() and line.split()[0] in absmean}
    assert [shown[s][-2] for s in ("embed", "hidden", "logits", "norm", "aux")] == ["0.5", "nan", "inf", "-inf", "-"]


def test_strict_json_names_what_it_cannot_hold() -> None:
    got = json_safe({"a": [math.nan, math.inf, -math.inf, 1.5, None, "NaN"]})
    assert json.dumps(got, allow_nan=False) == '{"a": ["NaN", "Infinity", "-Infinity", 1.5, null, "NaN"]}'
    assert [float(v) for v in got["a"][1:3]] == [math.inf, -math.inf] and math.isnan(float(got["a"][0]))


def test_a_diverged_loss_is_read_stored_and_shown_as_nan(orch: Orch, records_store: Store) -> None:
    parser = LogParser()
    read = parser.feed(b"{'loss': 2.5, 'epoch': 0.1}\n{'loss': nan, 'epoch': 0.2}\n"
                       b"orch-metric score=inf big=1e400 ok=1\n") + parser.finish()
    got = [(m.name, m.value) for m in read]
    assert ("big", math.inf) not in got  # a number too big for a float is no infinity the job printed
    assert ("score", math.inf) in got and ("ok", 1.0) in got
    losses = [v for n, v in got if n == "loss"]
    assert losses[0] == 2.5 and math.isnan(losses[-1])
    store = records_store
    run_id = store.create_run("train-draft", "local", {})
    for s in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING, Status.FAILED):
        transition(store, run_id, s)
    store.add_metrics(run_id, [(n, v, None) for n, v in got], time.time())
    assert math.isnan(store.latest_metrics(run_id)["loss"])
    assert math.isnan(store.metric_series(run_id, "loss")[-1][1])
    doc = json.loads(orch("status", str(run_id), "--json")[1])
    assert doc["metrics"]["loss"] == "NaN" and doc["metrics"]["score"] == "Infinity"
    assert doc["metric_summaries"]["loss"]["last"] == "NaN" and doc["metric_summaries"]["loss"]["mean"] == 2.5
    header, row = [line.split("\t") for line in orch("status")[1].splitlines()]
    assert "loss=nan" in dict(zip(header, row))["metrics"]
    # never the best of anything
    assert best(Objective(metric="loss", goal="min"), [("a", {"loss": math.nan}), ("b", {"loss": 3.0})]) == ("b", 3.0)
