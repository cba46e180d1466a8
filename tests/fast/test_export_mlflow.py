"""`orch export mlflow` in process, into a real MLflow file store read back with MLflow's own client: one MLflow
run per orch run found by its tag, each metric's samples as its steps, the record (and a receipt) as artifacts,
and exporting again adds nothing but what is new; without MLflow, one line and exit 2."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.ui import tracking

Orch = Callable[..., tuple[int, str, str]]
HOSTS = ""


@pytest.fixture
def orch(records_orch: Orch, monkeypatch: pytest.MonkeyPatch) -> Orch:
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # orch opts in for its own folder
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return records_orch


def a_run(store: Store, playbook: str, end: Status | None, reason: str = "", **spec: Any) -> int:
    run_id = store.create_run(playbook, "local", spec)
    for s in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, s)
    if end is not None:
        transition(store, run_id, end, reason, ended_at=time.time())
    return run_id


def mlflow_client(root: Path) -> Any:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=(root / "mlruns").as_uri())


def history(client: Any, run_id: str, name: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, name), key=lambda m: m.step)]


def test_runs_and_their_samples_are_exported_once(orch: Orch, records_store: Store, tmp_path: Path) -> None:
    store = records_store
    bench = a_run(store, "bench-serving", Status.SUCCEEDED, url="http://127.0.0.1:30000", num_prompts=200)
    server = a_run(store, "serve-vllm", Status.CANCELLED, reason="stopped by user", model="/m",
                   env={"HF_TOKEN": "***"})
    store.add_metrics(bench, [("completed", 200, None), ("output_throughput", 94.2, None)], 1000.0)
    store.add_metrics(server, [("gen_throughput", v, None, 2000.0 + i) for i, v in enumerate([10.0, 80.0, 88.8])],
                      2000.0)
    code, out, err = orch("export", "mlflow", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [(r["run"], r["created"], r["samples"]) for r in doc["runs"]] == [(bench, True, 2), (server, True, 3)]
    client = mlflow_client(tmp_path)
    experiment = client.get_experiment_by_name("orch")
    found = {int(r.data.tags["orch.run_id"]): r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(found) == [bench, server]
    b, s = found[bench], found[server]
    assert b.info.status == "FINISHED" and s.info.status == "KILLED" and s.data.tags["orch.status"] == "stopped"
    assert b.data.params["num_prompts"] == "200" and s.data.params["env.HF_TOKEN"] == "***"  # masked as stored
    assert b.data.tags["orch.headlines"].startswith("output_throughput,")
    assert history(client, s.info.run_id, "gen_throughput") == [(0, 10.0), (1, 80.0), (2, 88.8)]
    assert [m.timestamp for m in client.get_metric_history(s.info.run_id, "gen_throughput")] == [2000000, 2001000,
                                                                                                 2002000]
    record = json.loads(Path(client.download_artifacts(b.info.run_id, tracking.RECORD, str(tmp_path))).read_text())
    assert record["id"] == bench and record["metrics"] == {"output_throughput": 94.2, "completed": 200}

    # again: nothing new, nothing added
    code, out, _ = orch("export", "mlflow", "--json")
    assert [(r["created"], r["samples"], r["record"]) for r in json.loads(out)["runs"]] == [(False, 0, False)] * 2
    assert len(client.search_runs([experiment.experiment_id])) == 2
    assert len(client.get_metric_history(s.info.run_id, "gen_throughput")) == 3
    # a run that goes on: only its new samples, and its end
    live = a_run(store, "command", None, cmd="train.py")
    store.add_metrics(live, [("loss", 2.5, None)], 3000.0)
    orch("export", "mlflow", str(live))
    store.add_metrics(live, [("loss", 1.5, None)], 3001.0)
    transition(store, live, Status.SUCCEEDED, ended_at=time.time())
    code, out, _ = orch("export", "mlflow", str(live), "--json")
    assert [(r["created"], r["samples"]) for r in json.loads(out)["runs"]] == [(False, 1)]
    mine = client.search_runs([experiment.experiment_id], filter_string=f"tags.`orch.run_id` = '{live}'")
    assert len(mine) == 1 and mine[0].info.status == "FINISHED"
    assert history(client, mine[0].info.run_id, "loss") == [(0, 2.5), (1, 1.5)]


def test_a_receipt_goes_with_its_run(orch: Orch, records_store: Store, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run_id = a_run(records_store, "bench-serving", Status.SUCCEEDED, url="http://127.0.0.1:30000")
    receipt = {"engine": "vllm", "version": "0.32.0", "argv": ["vllm", "bench", "serve"]}
    documented = tracking.run_document
    monkeypatch.setattr(tracking, "run_document", lambda *a, **k: {**documented(*a, **k), "receipt": receipt})
    assert orch("export", "mlflow", "--tracking-uri", (tmp_path / "elsewhere").as_uri())[0] == 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "elsewhere").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("orch").experiment_id])
    assert run.data.tags["orch.run_id"] == str(run_id)
    got = Path(client.download_artifacts(run.info.run_id, tracking.RECEIPT, str(tmp_path))).read_text()
    assert json.loads(got) == receipt


def test_bad_input_or_no_mlflow_is_one_line_and_nothing_written(orch: Orch, records_store: Store, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    a_run(records_store, "command", Status.SUCCEEDED, cmd="true")
    code, _, err = orch("export", "mlflow", "1", "77")
    assert code == 2 and err.strip() == "orch: no run 77"
    assert not (tmp_path / "mlruns").exists()
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    code, _, err = orch("export", "mlflow")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "pip install 'orch[mlflow]'" in err
    assert not (tmp_path / "mlruns").exists()
