"""What `orch sweep status` shows: a sweep as a JSON document, point by point, and the list of sweeps."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..config import metricinfo
from ..config.objective import Objective, best, lower_is_better, of_doc
from ..store import Store, noise, receipts
from ..store import sweeps as stored_sweeps
from ..store.shapes import in_order, iso, shown_phase
from ..store.summaries import judged
from . import db, outcome, space
from .plan import label
from .record import INTERRUPTED, Fault, PointRow, SweepStatus
from .space import Constraint, Search

FOLLOW_S = 1.0  # how often a follower reads the record again


def _point(store: Store, pt: PointRow) -> dict[str, Any]:
    run = store.get_run(pt.run_id) if pt.run_id else None
    return {
        "index": pt.index, "point": pt.diff, "host": pt.host, "gpus": pt.gpus,
        "status": pt.status.value, "fault": pt.fault.value if pt.fault else None, "reason": pt.reason,
        "attempts": pt.attempts, "runs": stored_sweeps.runs_of_point(store, pt.sweep_id, pt.key),
        "run_id": pt.run_id, "run_status": run.status.value if run else None,
        "invalid": run.invalid if run else None,  # why its numbers count nowhere (None: they count)
        "phase": shown_phase(run) if run else None, "last_line": run.last_line if run else None,
        # the playbook's headlines first (shapes.in_order); a repeated benchmark's median (outcome.measured)
        "metrics": in_order(outcome.measured(store, run), metricinfo.headlines(run.playbook)) if run else {},
        # last, and mean and p50 over the steady state (see store/summaries.py)
        "metric_summaries": in_order(store.metric_summaries(run.id), metricinfo.headlines(run.playbook)) if run else {},
    }


def document(store: Store, sweep_id: int, with_events: bool = False, importance: bool = True) -> dict[str, Any]:
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
        pt["objective"] = pt["metrics"].get(objective.metric) if objective and not pt["invalid"] else None
    searched = _searched(row.doc)
    if searched is not None:
        for pt, rec in zip(points, db.points(store, sweep_id)):
            run = store.get_run(rec.run_id) if rec.run_id else None
            pt["cause"] = outcome.cause_of(rec.fault is Fault.JOB, rec.reason, run) if rec.status.value == "failed" \
                else None
            pt["stage"] = searched[0].stage_of(rec.diff)
    doc: dict[str, Any] = {
        "id": row.id, "name": row.name, "instance": row.instance, "playbook": row.playbook,
        "status": status, "path": row.path,
        "file_hash": row.file_hash, "created_at": row.created_at, "ended_at": row.ended_at,
        "controller": str(row.controller) if row.controller else None, "notify": row.notify, "counts": counts,
        "objective": objective.model_dump() if objective else None, "best": best_point(objective, points),
        "points": points,
        # an ended sweep: each point against its own history (earlier sweeps of the same name)
        "regressions": regressions(store, sweep_id) if row.status.ended else [],
    }
    doc["regression_line"] = regression_line(doc["regressions"])
    if searched is not None and objective is not None:
        doc["search"] = findings(searched[0], searched[1], objective, points, doc["best"], importance)
    if with_events:
        doc["events"] = [{"ts": e["ts"], "ts_iso": iso(e["ts"]), "kind": e["kind"], "message": e["message"]}
                         for e in stored_sweeps.events(store, sweep_id)]
    return doc


def _searched(doc: dict[str, Any] | None) -> tuple[Search, dict[str, Constraint]] | None:
    """A stored searching sweep's [search] and [constraints], read again; None for a grid."""
    if not doc or not doc.get("search"):
        return None
    return space.parse(doc["search"]), space.constraints(doc.get("constraints") or {})


def findings(search: Search, bounds: dict[str, Constraint], objective: Objective, points: list[dict[str, Any]],
             best: dict[str, Any] | None, importance: bool = True) -> dict[str, Any]:
    """What a search found, beyond its best point: how far it got, the objective trial by trial with the best
    so far, the throughput-latency Pareto front (when a bound is on a latency), and which keys mattered
    (`importance`: asked of the optimizer, which takes a moment; None when not asked)."""
    counts: dict[str, int] = {}
    for p in points:
        key = f"failed: {p['cause']}" if p["status"] == "failed" and p.get("cause") else p["status"]
        counts[key] = counts.get(key, 0) + 1
    history, so_far = [], None
    for p in points:
        if p["status"] == "succeeded" and p["objective"] is not None and (
                so_far is None or objective.better(p["objective"], so_far)):
            so_far = p["objective"]
        history.append({"index": p["index"], "status": p["status"], "objective": p["objective"], "best": so_far})
    return {
        "trials": search.trials, "done": sum(p["status"] not in ("queued", "running") for p in points),
        "stages": [{"trials": s.trials, "keys": list(s.space)} for s in search.stages],
        "constraints": {m: c.model_dump(exclude_none=True) for m, c in bounds.items()},
        "trial_states": counts, "history": history,
        "pareto": pareto(objective, bounds, points),
        "importance": _importances(search, objective, points) if importance else None,
        "best_receipt": _receipt(best, points),
    }


def _importances(search: Search, objective: Objective, points: list[dict[str, Any]]) -> dict[str, float] | None:
    from .search import importances  # (Optuna: only a search's status imports it)

    return importances(search, objective, points)


def pareto(objective: Objective, bounds: dict[str, Constraint], points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The points no other beats on both the objective and the first bounded latency (lower is better): the
    trade-off a bound on that latency cuts through. None when no bound is on a latency."""
    latency = next((m for m in bounds if lower_is_better(m)), None)
    if latency is None:
        return None
    pairs = [(p, p["objective"], p["metrics"].get(latency)) for p in points
             if p["status"] in ("succeeded", "infeasible") and p["objective"] is not None
             and p["metrics"].get(latency) is not None]

    def beats(a: tuple[float, float], b: tuple[float, float]) -> bool:
        at_least = not objective.better(b[0], a[0]) and a[1] <= b[1]
        return at_least and (objective.better(a[0], b[0]) or a[1] < b[1])

    front = [(p, v, lat) for p, v, lat in pairs if not any(beats((v2, l2), (v, lat)) for _, v2, l2 in pairs)]
    front.sort(key=lambda f: f[2])
    return {"metric": latency, "points": [{"index": p["index"], "objective": v, latency: lat,
                                           "feasible": p["status"] == "succeeded"} for p, v, lat in front]}


def _receipt(best: dict[str, Any] | None, points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What produced the best point's numbers: its run, host and spec differences, and every metric it recorded."""
    if best is None:
        return None
    p = next(p for p in points if p["index"] == best["index"])
    return {"run_id": p["run_id"], "host": p["host"], "point": p["point"], "metrics": p["metrics"]}


def best_point(objective: Objective | None, points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The succeeded, valid point that is best by the objective: its index, run and value."""
    if objective is None:
        return None
    found = best(objective, ((p, p["metrics"]) for p in points if p["status"] == "succeeded" and not p["invalid"]))
    if found is None:
        return None
    p, value = found
    return {"index": p["index"], "run_id": p["run_id"], "metric": objective.metric, "goal": objective.goal,
            "value": value}


def best_line(doc: dict[str, Any]) -> str | None:
    """The sweep's verdict: its best valid point by the objective, or why there is none yet; then, on a line
    of its own, any regression or gain against the points' history."""
    moved = doc.get("regression_line")
    objective = doc["objective"]
    if objective is None:
        return moved
    way = "higher" if objective["goal"] == "max" else "lower"
    found = doc["best"]
    if found is None:
        line = f"best: none yet (no valid succeeded point recorded {objective['metric']}; {way} is better)"
    else:
        pt = next(p for p in doc["points"] if p["index"] == found["index"])
        line = (f"best: #{pt['index']} {label(pt['point'] or {})} (run {found['run_id']}): "
                f"{objective['metric']}={found['value']:g} ({way} is better)")
    return f"{line}\n{moved}" if moved else line


def search_lines(doc: dict[str, Any]) -> list[str]:
    """A search's findings as a person reads them: trial states, the objective trial by trial, the Pareto
    front, the keys that mattered. [] for a grid."""
    found = doc.get("search")
    if not found:
        return []
    metric = doc["objective"]["metric"]
    states = ", ".join(f"{n} {s}" for s, n in sorted(found["trial_states"].items()))
    lines = [f"search: {found['done']} of {found['trials']} trials done: {states}"]
    if found["history"]:
        lines.append(f"{metric} by trial: " + " ".join(
            "-" if h["objective"] is None else f"{h['objective']:.4g}" + ("*" if h["status"] == "succeeded" and
                                                                          h["objective"] == h["best"] else "")
            for h in found["history"]) + "  (* a new best)")
    front = found.get("pareto")
    if front and front["points"]:
        lat = front["metric"]
        lines.append(f"Pareto front ({metric} vs {lat}): " + ", ".join(
            f"#{f['index']} {f['objective']:.4g} at {f[lat]:.4g}" + ("" if f["feasible"] else " (infeasible)")
            for f in front["points"]))
    if found.get("importance"):
        lines.append("importance: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                sorted(found["importance"].items(), key=lambda kv: -kv[1])))
    return lines


def list_sweeps(store: Store, limit: int = 50) -> list[dict[str, Any]]:
    docs = [document(store, i, importance=False) for i in stored_sweeps.ids(store, limit)]
    for d in docs:
        del d["points"]
    return docs


def follow(store: Store, sweep_id: int, on_doc: Callable[[dict[str, Any]], None],
           sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Read the sweep's record until it ends (or its controller died: interrupted), handing every reading to
    `on_doc`; the last one is returned. Nothing is asked of any host: the controller's watchers write it."""
    while True:
        doc = document(store, sweep_id, importance=False)
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
    if p["status"] in ("succeeded", "infeasible") and objective and p["objective"] is not None:
        line += f", {objective}={p['objective']:g}"
    if p["status"] in ("failed", "cancelled", "pruned", "infeasible") and p["reason"]:
        line += f": {p['reason']}"
    if p.get("invalid"):
        line += f" (invalid: {p['invalid']})"
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


# --- regressions: each point against its own history -----------------------------------------------
HISTORY_SWEEPS = 30  # the earlier sweeps of the same name a point's history is looked for in


def regressions(store: Store, sweep_id: int) -> list[dict[str, Any]]:
    """Each point of the sweep against the same point (the same swept values) the last time a sweep of the
    same name ran it validly: every metric that moved beyond the measured spread of both runs
    (store/noise.py) as a regression (`worse`) or a gain (`better`), naming what changed in the receipt
    (engine version, patch set, driver, flags). The objective's metric is weighed, else the playbook's
    headlines, else every metric with a direction; another model, data set or GPU is no regression."""
    row = db.sweep(store, sweep_id)
    earlier = [r["id"] for r in stored_sweeps.of_name(store, row.name, HISTORY_SWEEPS + 1) if r["id"] < sweep_id]
    if not earlier:
        return []
    before: dict[str, int] = {}  # point key -> its latest valid succeeded run in an earlier sweep
    for other in earlier:  # newest first: the first found is the latest
        for pt in db.points(store, other):
            if pt.run_id is not None and pt.key not in before and _counts(store.get_run(pt.run_id)):
                before[pt.key] = pt.run_id
    objective = of_doc(row.doc)
    found = []
    for pt in db.points(store, sweep_id):
        if pt.run_id is None or pt.key not in before:
            continue
        now, then = store.get_run(pt.run_id), store.get_run(before[pt.key])
        if not _counts(now):
            continue
        changed = receipts.differences(then.receipt, now.receipt)
        if any(d["matters"] for d in changed):
            continue  # another model, data set or machine: not this point's history
        a, b = store.metric_values(then.id), store.metric_values(now.id)
        names = [objective.metric] if objective else list(metricinfo.headlines(now.playbook)) or sorted(b)
        for name in names:
            direction = metricinfo.direction(name)
            if name not in a or name not in b or direction is None:
                continue
            x, y = judged(name, a[name]), judged(name, b[name])
            verdict, why = noise.verdict(x, y, direction)
            if verdict in ("better", "worse"):
                found.append({"index": pt.index, "point": pt.diff, "metric": name, "verdict": verdict,
                              "run_id": now.id, "previous_run_id": then.id, "why": why,
                              "before": noise.noise(x), "after": noise.noise(y),
                              "changed": [receipts.line(d) for d in changed]})
    return found


def _counts(run: Any) -> bool:
    return run.status.value == "succeeded" and not run.invalid


def regression_line(found: list[dict[str, Any]]) -> str | None:
    """The regressions and gains in one short line, then what changed in the receipts (None: nothing moved
    beyond its noise): `2 regressions beyond the noise: #0 B=4 tput 81.3 -> 64.4, ...; changed: ...`."""
    if not found:
        return None
    parts = []
    for verdict, word in (("worse", "regression"), ("better", "gain")):
        these = [r for r in found if r["verdict"] == verdict]
        if these:
            points = ", ".join(f"#{r['index']} {label(r['point'] or {})} {r['metric']} "
                               f"{r['before']['median']:.4g} -> {r['after']['median']:.4g}" for r in these)
            parts.append(f"{len(these)} {word}{'s' if len(these) > 1 else ''} beyond the noise: {points}")
    changes = list(dict.fromkeys(c for r in found for c in r["changed"]))
    more = f" (+{len(changes) - 2} more)" if len(changes) > 2 else ""
    return "; ".join(parts) + "; changed: " + (", ".join(changes[:2]) + more if changes else "nothing in the receipt")
