"""What `orch sweep status` shows: a sweep as a JSON document, point by point, and the list of sweeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..config import metricinfo
from ..config.objective import Objective, best, of_doc
from ..store import Store
from ..store import sweeps as stored_sweeps
from ..store.shapes import in_order, iso, shown_phase
from . import db
from .plan import label
from .record import INTERRUPTED, PointRow, SweepStatus

FOLLOW_S = 1.0  # how often a follower reads the record again


def _point(store: Store, pt: PointRow) -> dict[str, Any]:
    run = store.get_run(pt.run_id) if pt.run_id else None
    return {
        "index": pt.index, "point": pt.diff, "host": pt.host, "gpus": pt.gpus,
        "status": pt.status.value, "fault": pt.fault.value if pt.fault else None, "reason": pt.reason,
        "attempts": pt.attempts, "runs": stored_sweeps.runs_of_point(store, pt.sweep_id, pt.key),
        "run_id": pt.run_id, "run_status": run.status.value if run else None,
        "phase": shown_phase(run) if run else None, "last_line": run.last_line if run else None,
        # the playbook's headlines first (shapes.in_order)
        "metrics": in_order(store.latest_metrics(run.id), metricinfo.headlines(run.playbook)) if run else {},
        # last, and mean and p50 over the steady state (see store/summaries.py)
        "metric_summaries": in_order(store.metric_summaries(run.id), metricinfo.headlines(run.playbook)) if run else {},
    }


def document(store: Store, sweep_id: int, with_events: bool = False) -> dict[str, Any]:
    """The JSON shape of a sweep that `orch sweep status --json` prints; with events, its history too (what
    the controller did, in order)."""
    row = db.sweep(store, sweep_id)
    status = row.status.value
    if row.status is SweepStatus.RUNNING and not row.controller_alive():
        status = INTERRUPTED  # its controller died: running the file again resumes it
    points = [_point(store, pt) for pt in db.points(store, sweep_id)]
    counts: dict[str, int] = {}
    for pt in points:
        counts[pt["status"]] = counts.get(pt["status"], 0) + 1
    objective = of_doc(row.doc)
    for pt in points:  # the value that decides, first: each point's objective
        pt["objective"] = pt["metrics"].get(objective.metric) if objective else None
    doc: dict[str, Any] = {
        "id": row.id, "name": row.name, "instance": row.instance, "playbook": row.playbook,
        "status": status, "path": row.path,
        "file_hash": row.file_hash, "created_at": row.created_at, "ended_at": row.ended_at,
        "controller": str(row.controller) if row.controller else None, "notify": row.notify, "counts": counts,
        "objective": objective.model_dump() if objective else None, "best": best_point(objective, points),
        "points": points,
    }
    if with_events:
        doc["events"] = [{"ts": e["ts"], "ts_iso": iso(e["ts"]), "kind": e["kind"], "message": e["message"]}
                         for e in stored_sweeps.events(store, sweep_id)]
    return doc


def best_point(objective: Objective | None, points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The succeeded point that is best by the objective: its index, run and value."""
    if objective is None:
        return None
    found = best(objective, ((p, p["metrics"]) for p in points if p["status"] == "succeeded"))
    if found is None:
        return None
    p, value = found
    return {"index": p["index"], "run_id": p["run_id"], "metric": objective.metric, "goal": objective.goal,
            "value": value}


def best_line(doc: dict[str, Any]) -> str | None:
    """The sweep's verdict in one line: its best point by the objective, or why there is none yet."""
    objective = doc["objective"]
    if objective is None:
        return None
    way = "higher" if objective["goal"] == "max" else "lower"
    found = doc["best"]
    if found is None:
        return f"best: none yet (no succeeded point recorded {objective['metric']}; {way} is better)"
    pt = next(p for p in doc["points"] if p["index"] == found["index"])
    return (f"best: #{pt['index']} {label(pt['point'] or {})} (run {found['run_id']}): "
            f"{objective['metric']}={found['value']:g} ({way} is better)")


def list_sweeps(store: Store, limit: int = 50) -> list[dict[str, Any]]:
    docs = [document(store, i) for i in stored_sweeps.ids(store, limit)]
    for d in docs:
        del d["points"]
    return docs


def follow(store: Store, sweep_id: int, on_doc: Callable[[dict[str, Any]], None],
           sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Read the sweep's record until it ends (or its controller died: interrupted), handing every reading to
    `on_doc`; the last one is returned. Nothing is asked of any host: the controller's watchers write it."""
    while True:
        doc = document(store, sweep_id)
        on_doc(doc)
        if doc["status"] == INTERRUPTED or SweepStatus(doc["status"]).ended:
            return doc
        sleep(FOLLOW_S)


def point_line(p: dict[str, Any], objective: str | None = None) -> str:
    """One point as a follower shows it: which point, where, how far, and its log's last line."""
    where = p["host"] + (f":{p['gpus']}" if p["gpus"] else "")
    line = f"#{p['index']} {label(p['point'] or {})} on {where}: {p['status']}"
    if p["run_id"]:
        line += f", run {p['run_id']}"
    if p["status"] == "running" and p["phase"]:
        line += f" ({p['phase']})"
    if p["status"] == "succeeded" and objective and p["objective"] is not None:
        line += f", {objective}={p['objective']:g}"
    if p["status"] in ("failed", "cancelled") and p["reason"]:
        line += f": {p['reason']}"
    if p["status"] == "running" and p["last_line"]:
        line += f" · {p['last_line']}"
    return line


def changes(before: dict[str, Any] | None, doc: dict[str, Any]) -> list[str]:
    """The lines a follower prints for a new reading: each point whose status, run or phase moved, then the
    sweep's own status when it moved."""
    objective = doc["objective"]["metric"] if doc["objective"] else None
    if before is None:  # the first reading: where every point stands, the queued ones counted
        counts = ", ".join(f"{n} {s}" for s, n in sorted(doc["counts"].items()))
        return [*(point_line(p, objective) for p in doc["points"] if p["status"] != "queued"),
                f"sweep {doc['id']} ({doc['name']}): {doc['status']}; {len(doc['points'])} points: {counts}"]
    seen = {p["index"]: p for p in before["points"]}
    lines = [point_line(p, objective) for p in doc["points"]
             if (old := seen.get(p["index"])) is None
             or any(old[k] != p[k] for k in ("status", "run_id", "phase"))]
    if before["status"] != doc["status"]:
        lines.append(f"sweep {doc['id']} ({doc['name']}): {doc['status']}")
    return lines
