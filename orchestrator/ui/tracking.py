"""`orch export mlflow`: runs, their records (the receipt too, where a run has one) and metrics into an MLflow
tracking store, for teams who already look there. SQLite stays the truth; the export only reads it.

One MLflow run per orch run, found again by its `orch.run_id` tag, so exporting again adds nothing: only the
samples recorded since (a metric's samples are its steps 0, 1, 2, ... in recorded order), the tags of a run
whose state changed, and its record once it changed. MLflow is the optional `mlflow` extra (mlflow-skinny):
imported only here, and its absence is one line.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..config import metricinfo
from ..errors import UsageError
from ..store import Store
from ..store.encoding import json_safe
from ..store.receipts import flatten
from ..store.record import RunRecord, Status
from ..store.shapes import run_document, shown_status

EXPERIMENT = "orch"
RUN_TAG = "orch.run_id"
STATE_TAG = "orch.state"  # what the record was when last exported: its status, phase and end
RECORD = "orch/run.json"
RECEIPT = "orch/receipt.json"
BATCH = 1000  # MLflow's most metrics in one log_batch
PARAMS_BATCH = 100
PARAM_VALUE_MAX = 6000
TAG_VALUE_MAX = 5000
_UNSAFE = re.compile(r"[^\w\-. /:]")  # what MLflow refuses in a metric or param name
STATUS = {Status.SUCCEEDED: "FINISHED", Status.FAILED: "FAILED", Status.LOST: "FAILED", Status.CANCELLED: "KILLED"}


@dataclass(frozen=True)
class Exported:
    """What one export did for one orch run."""

    run: int
    mlflow_run: str
    created: bool
    samples: int  # metric samples added now
    record: bool  # the record (and receipt) written now

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def client(tracking_uri: str) -> Any:
    """MLflow's client of that store, or a UsageError when MLflow is not installed."""
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise UsageError("orch export mlflow needs MLflow: pip install 'orch[mlflow]' (mlflow-skinny)") from None
    if "://" not in tracking_uri or tracking_uri.startswith("file:"):
        # a folder of files: MLflow 3 asks for this opt-in to write one (a database backend needs more than
        # mlflow-skinny); the user's own setting wins
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return MlflowClient(tracking_uri=tracking_uri)


def default_uri(root: Path) -> str:
    """The workspace's own store: `mlruns/` beside `runs/`."""
    return (root / "mlruns").resolve().as_uri()


def export(store: Store, runs: Sequence[RunRecord], tracking_uri: str, experiment: str = EXPERIMENT,
           echo: Callable[[Exported], None] = lambda e: None) -> list[Exported]:
    """Each run into the store at `tracking_uri` (under `experiment`), added to what an earlier export left."""
    mlflow = client(tracking_uri)
    if not runs:
        return []
    found = mlflow.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else mlflow.create_experiment(experiment)
    exported = _exported(mlflow, experiment_id)
    done = []
    for run in runs:
        result = _one(mlflow, experiment_id, store, run, exported.get(str(run.id)))
        echo(result)
        done.append(result)
    return done


def _exported(mlflow: Any, experiment_id: str) -> dict[str, Any]:
    """The MLflow runs an earlier export made in the experiment, by their orch run id (one search, paged)."""
    found: dict[str, Any] = {}
    token = None
    while True:
        page = mlflow.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` != ''", max_results=1000,
                                  page_token=token)
        for r in page:
            found.setdefault(r.data.tags[RUN_TAG], r)
        token = page.token
        if not token:
            return found


def _name(text: str) -> str:
    return _UNSAFE.sub("_", text)[:250]


def _one(mlflow: Any, experiment_id: str, store: Store, run: RunRecord, existing: Any) -> Exported:
    from mlflow.entities import Metric, Param, RunTag

    created = existing is None
    if created:
        mine = mlflow.create_run(experiment_id, start_time=int(run.created_at * 1000),
                                 tags={RUN_TAG: str(run.id)}, run_name=run.name or f"{run.playbook} {run.id}")
        mlflow_id, params, tags = mine.info.run_id, {}, {}
    else:
        mlflow_id, params, tags = existing.info.run_id, existing.data.params, existing.data.tags
    # samples: each metric's in recorded order, its steps; those MLflow has already are not sent again
    added = []
    for name in metricinfo.order(store.latest_metrics(run.id), run.playbook):
        key = _name(name)
        have = 0 if created else len(mlflow.get_metric_history(mlflow_id, key))
        for step, (ts, value, _) in enumerate(store.metric_series(run.id, name)):
            if step >= have:
                added.append(Metric(key, float(value), int(ts * 1000), step))
    for i in range(0, len(added), BATCH):
        mlflow.log_batch(mlflow_id, metrics=added[i:i + BATCH])
    new_params = [Param(_name(k), _text(v, PARAM_VALUE_MAX)) for k, v in flatten(run.spec or {}).items()
                  if _name(k) not in params]  # a param is written once: MLflow keeps it as first logged
    for i in range(0, len(new_params), PARAMS_BATCH):
        mlflow.log_batch(mlflow_id, params=new_params[i:i + PARAMS_BATCH])
    state = json.dumps([run.status.value, run.phase, run.ended_at, run.reason])
    wrote = tags.get(STATE_TAG) != state
    if wrote:  # the run changed since the last export (or was never exported): its record and tags again
        doc = json_safe(run_document(store, run, headlines=metricinfo.headlines(run.playbook)))
        mlflow.log_dict(mlflow_id, doc, RECORD)
        if doc.get("receipt") is not None:
            mlflow.log_dict(mlflow_id, doc["receipt"], RECEIPT)
        mlflow.log_batch(mlflow_id, tags=[RunTag(k, _text(v, TAG_VALUE_MAX)) for k, v in _tags(run, state).items()])
        if run.status.terminal:
            mlflow.set_terminated(mlflow_id, STATUS[run.status],
                                  end_time=int((run.ended_at or run.created_at) * 1000))
    return Exported(run.id, mlflow_id, created, len(added), wrote)


def _tags(run: RunRecord, state: str) -> dict[str, Any]:
    return {"orch.playbook": run.playbook, "orch.host": run.host, "orch.status": shown_status(run, None),
            "orch.phase": run.phase or "", "orch.reason": run.reason or "", "orch.tags": ",".join(run.tags or []),
            "orch.headlines": ",".join(metricinfo.headlines(run.playbook)), STATE_TAG: state,
            **({"mlflow.note.content": run.note} if run.note else {})}


def _text(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else json.dumps(json_safe(value))
    return text[:limit]


def runs_of(store: Store, ids: Iterable[int]) -> list[RunRecord]:
    """The runs to export, oldest first: those named (each must exist: NotFound before anything is
    written), else every run of the workspace."""
    wanted = list(ids)
    if wanted:
        return [store.get_run(i) for i in sorted(set(wanted))]
    return sorted(store.list_runs(limit=10**9), key=lambda r: r.id)
