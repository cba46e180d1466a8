"""What the dashboard's pages show, as JSON documents: a run, a sweep as a pivot, the hosts, a compare."""

from __future__ import annotations

import json
import math
import shlex
from typing import Any

from .. import sweep
from ..config import metricinfo
from ..config.hosts import Inventory
from ..config.workspace import Workspace
from ..errors import OrchError
from ..runflow import registry
from ..store import Store, runtables
from ..store import sweeps as stored_sweeps
from ..store.record import RunRecord
from ..store.shapes import error_hint, run_document, shown_status

SERIES_POINTS = 600  # a chart needs no more points than it has pixels
SERIES_ROWS = 200_000  # the newest samples of a run that a chart reads at most
OUTPUTS_BYTES = 256 << 10
TREND_SWEEPS = 30
END_PHASES = ("finished", "failed")


# a run -----------------------------------------------------------------------------------------------
def run_page(ws: Workspace, store: Store, run_id: int) -> dict[str, Any]:
    """Everything the run page shows except the log tail and the metric series (fetched on their own)."""
    run = store.get_run(run_id)
    doc = run_document(store, run, tables=runtables.installed(), headlines=metricinfo.headlines(run.playbook))
    doc.update({
        "heartbeat": run.heartbeat, "progress_at": run.progress_at, "watcher": run.watcher,
        # in full: the line number, the lines around it, the chained exceptions, the remedy
        "error": run.error and {**run.error, "hint": error_hint(run.error)},
        "timeline": timeline(run, doc["events"]),
        "spec_keys": spec_keys(run),
        "patches": store.patch_records_of_run(run_id),
        "outputs": outputs(ws, run_id),
        "reproduce": reproduce(run),
    })
    return doc


def timeline(run: RunRecord, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The phases the run went through, each with when it began, then its end."""
    steps = [{"phase": "created", "ts": run.created_at}]
    if run.started_at is not None:
        steps.append({"phase": "starting", "ts": run.started_at})
    for e in events:
        ended = run.ended_at is not None and e["message"] in END_PHASES  # the end itself says how it ended
        if e["kind"] == "phase" and e["message"] != steps[-1]["phase"] and not ended:
            steps.append({"phase": e["message"], "ts": e["ts"]})
    if run.ended_at is not None:  # the word a person reads: `stopped` for a run ended on purpose
        steps.append({"phase": shown_status(run, None), "ts": run.ended_at})
    return steps


def _defaults(playbook: str) -> dict[str, Any]:
    try:
        fields = registry.playbook(playbook).Spec.model_fields
    except OrchError:  # a playbook no longer installed: every key counts as set
        return {}
    return {name: f.get_default(call_default_factory=True) for name, f in fields.items() if not f.is_required()}


_UNSET = object()


def spec_keys(run: RunRecord) -> list[dict[str, Any]]:
    """The spec's keys, those that differ from the playbook's defaults first."""
    defaults = _defaults(run.playbook)
    rows = [{"key": k, "value": v, "changed": defaults.get(k, _UNSET) != v} for k, v in (run.spec or {}).items()]
    return sorted(rows, key=lambda r: not r["changed"])


def outputs(ws: Workspace, run_id: int) -> Any:
    """The outputs manifest the run's end wrote (runs/<id>/outputs.json), if any."""
    path = ws.runs_dir / str(run_id) / "outputs.json"
    try:
        with path.open("rb") as f:
            return json.loads(f.read(OUTPUTS_BYTES))
    except (OSError, ValueError):
        return None


def _set_arg(key: str, value: Any) -> list[str]:
    if isinstance(value, dict):
        return [a for k, v in value.items() for a in _set_arg(f"{key}.{k}", v)]
    if value is None:
        return []
    # strings as they are (a str field takes `--set cmd=...` raw); anything else as a TOML literal,
    # which JSON's numbers, booleans and arrays of them are
    return ["--set", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]


def reproduce(run: RunRecord) -> str:
    """The command that starts this run again: its playbook and host, and the keys it set."""
    argv = ["orch", "run", run.playbook, "--host", run.host]
    for row in spec_keys(run):
        if row["changed"]:
            argv += _set_arg(row["key"], row["value"])
    return shlex.join(argv)


def metric_series(store: Store, run_id: int) -> dict[str, list[list[float]]]:
    """Each metric of a run over time, [[ts, value], ...], thinned to at most SERIES_POINTS points."""
    found: dict[str, list[list[float]]] = {}
    for name, ts, value in store.recent_samples(run_id, SERIES_ROWS):
        if math.isfinite(value):  # a chart draws numbers: a NaN sample is in the run's metrics, not on its line
            found.setdefault(name, []).append([ts, value])
    # the charts in the order the metrics are read: the playbook's headlines first
    series = {name: found[name] for name in metricinfo.order(found, store.get_run(run_id).playbook)}
    for name, points in series.items():
        if len(points) > SERIES_POINTS:
            step = len(points) / SERIES_POINTS
            series[name] = [points[int(i * step)] for i in range(SERIES_POINTS - 1)] + [points[-1]]
    return series


# a sweep ---------------------------------------------------------------------------------------------
def sweep_page(store: Store, sweep_id: int, objective: str | None = None) -> dict[str, Any]:
    """The sweep as a pivot: a row per point, its swept keys and latest metrics, the best marked."""
    doc = sweep.document(store, sweep_id)
    points = doc["points"]
    keys = list(dict.fromkeys(k for p in points for k in (p["point"] or {})))
    # the playbook's headlines first, then the rest by name
    names = metricinfo.order((n for p in points for n in p["metrics"]), doc["playbook"])
    declared = doc["objective"]  # the sweep file's objective: the page opens on it, in its direction
    direction = {n: ("lower" if declared["goal"] == "min" else "higher") if declared and declared["metric"] == n
                 else metricinfo.direction(n) for n in names}
    lower = {n: direction[n] == "lower" for n in names}
    best = {n: _best(points, n, lower[n]) if direction[n] else None for n in names}  # a count has no best
    if doc.get("search") and declared:  # a search's best keeps its bounds: never a pruned or infeasible point
        best[declared["metric"]] = doc["best"]["index"] if doc["best"] else None
        doc["search_lines"] = sweep.search_lines(doc)
    if objective not in names:
        judged = [n for n in names if direction[n]]
        objective = declared["metric"] if declared and declared["metric"] in names else next(iter(judged or names), None)
    # the objective's column first, then the others
    names = [n for n in names if n == objective] + [n for n in names if n != objective]
    doc.update({
        "keys": keys, "metrics": names, "best": best, "objective": objective, "declared": declared,
        "lower_is_better": lower, "direction": direction,
        "trend": trend(store, doc["name"], objective, lower[objective]) if objective and direction[objective] else [],
    })
    return doc


def _best(points: list[dict[str, Any]], metric: str, lower: bool) -> int | None:
    """The index of the best point by a metric (its run's latest value)."""
    scored = [(p["metrics"][metric], p["index"]) for p in points if not p["invalid"]
              and isinstance(p["metrics"].get(metric), int | float) and math.isfinite(p["metrics"][metric])]
    if not scored:
        return None
    return (min if lower else max)(scored)[1]


def trend(store: Store, name: str, metric: str, lower: bool) -> list[dict[str, Any]]:
    """The best value of a metric in each earlier sweep of the same name (a nightly file's nights)."""
    pick = min if lower else max
    found = []
    for row in reversed(stored_sweeps.of_name(store, name, TREND_SWEEPS)):
        values = [v for v in stored_sweeps.latest_values(store, row["id"], metric) if math.isfinite(v)]
        if values:
            found.append({"sweep_id": row["id"], "instance": row["instance"], "created_at": row["created_at"],
                          "best": pick(values)})
    return found


def sweeps_page(store: Store) -> list[dict[str, Any]]:
    return sweep.list_sweeps(store, limit=200)


# hosts and compare -----------------------------------------------------------------------------------
def hosts_page(ws: Workspace, store: Store) -> list[dict[str, Any]]:
    """The inventory, with each host's active and total runs (GPUs and reachability are asked on demand)."""
    inv = Inventory.load(ws.hosts_file, ws.root)
    counts = store.run_counts()
    return [{"name": h.name, "address": h.address or h.name, "gpus": h.gpus, "tags": h.tags,
             "scheduler": h.scheduler, "runs": counts.get(h.name, {})} for h in inv.hosts.values()]


def gpus(ws: Workspace, store: Store, names: list[str], timeout: float) -> dict[str, Any]:
    """A GPU snapshot of each named host (who holds each GPU included), or its error in words."""
    from ..host import gpu

    inv = Inventory.load(ws.hosts_file, ws.root)
    found = gpu.snapshots([inv.get(n) for n in names], store, timeout=timeout)
    return {name: {"error": str(s)} if isinstance(s, Exception) else {"snapshot": gpu.snapshot_to_dict(s)}
            for name, s in found.items()}


def reachability(ws: Workspace, names: list[str], timeout: float) -> dict[str, Any]:
    from ..host import fleet

    inv = Inventory.load(ws.hosts_file, ws.root)
    return fleet.check([inv.get(n) for n in names], timeout)
