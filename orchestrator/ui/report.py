"""Reports over recorded runs: specs and metrics side by side, ratios against the first run."""

from __future__ import annotations

import html
import json
import os
import time
from typing import Any

from ..config import metricinfo
from ..config.objective import Objective, best, lower_is_better, of_doc
from ..errors import UsageError
from ..store import Store, noise, receipts
from ..store import sweeps as stored_sweeps
from ..store.receipts import flatten  # a spec's nested tables as dotted keys, as a receipt's
from ..store.record import RunRecord, Status
from ..store.summaries import judged

RATIO_DIGITS = 4


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return round(value / base, RATIO_DIGITS)


def _better(value: float | None, base: float | None, lower: bool) -> bool | None:
    """Is the value better than the baseline's, in the metric's direction (None: equal, or one missing)?"""
    if value is None or base is None or value == base:
        return None
    return value < base if lower else value > base


def compare(store: Store, ids: list[int], all_keys: bool = False, baseline: int | None = None,
            metric_names: list[str] | None = None) -> dict[str, Any]:
    """Specs (only the keys that differ unless `all_keys`) and latest metrics of runs, in the order given,
    each metric with its summaries (last, mean and p50 over the steady state).

    A key or metric a run lacks is None for it; ratios are each run's value over the first run's, which
    is the baseline run when one is given (it comes first, whether or not it is among `ids`).

    First come the `differences` between the first run's receipt and each other's (what changed: a flag
    of the server, a patch set, the engine version); each metric then has a `verdict` of every run against
    the first (`verdicts`; `verdict`: the last run's), judged from each run's samples (a benchmark's
    repeats, a server's steady state) in the metric's direction: better, worse, within_noise, or
    incomparable (an invalid run, another model, data set or GPU, too few samples). Headline metrics come
    first; `metric_names` keeps only those.
    """
    if baseline is not None:
        ids = [baseline, *(i for i in ids if i != baseline)]
    if len(ids) < 2:
        raise UsageError("compare needs at least two runs")
    runs = [store.get_run(i) for i in ids]  # an unknown id raises NotFound (bad input)
    specs = [flatten(r.spec) for r in runs]
    spec: dict[str, list[Any]] = {}
    for key in _ordered_union(specs):
        values = [s.get(key) for s in specs]
        if all_keys or any(v != values[0] for v in values[1:]):
            spec[key] = values
    latest = [store.latest_metrics(i) for i in ids]
    summed = [store.metric_summaries(i) for i in ids]
    series = [store.metric_values(i) for i in ids]
    diffs = [receipts.differences(runs[0].receipt, r.receipt) for r in runs[1:]]
    # why a run's numbers cannot be set against the first's at all, whichever the metric
    apart = [None, *(_apart(runs[0], r, d) for r, d in zip(runs[1:], diffs))]
    names = metricinfo.order(_ordered_union(latest), runs[-1].playbook)
    if metric_names:
        missing = [m for m in metric_names if m not in names]
        if missing:
            raise UsageError(f"no metric {', '.join(missing)} in these runs (known: {', '.join(names) or 'none'})")
        names = [n for n in names if n in metric_names]
    heads = set(metricinfo.headlines(runs[-1].playbook))
    metrics: dict[str, dict[str, Any]] = {}
    for name in names:
        values = [m.get(name) for m in latest]
        lower = lower_is_better(name)
        samples = [judged(name, s.get(name, [])) for s in series]
        given = [None, *(_verdict(name, samples[0], samples[i], apart[i]) for i in range(1, len(ids)))]
        metrics[name] = {"name": name, "headline": name in heads,
                         "values": values, "ratios": [ratio(v, values[0]) for v in values], "lower_is_better": lower,
                         "better": [None, *(_better(v, values[0], lower) for v in values[1:])],
                         # last, mean and p50 over the steady state, per run (see store/summaries.py)
                         "summaries": [s.get(name) for s in summed],
                         "noise": [noise.noise(x) if x else None for x in samples],
                         "verdicts": [None if j is None else j[0] for j in given],
                         "why": [None if j is None else j[1] for j in given],
                         "verdict": given[-1][0] if given[-1] else None}
    return {"runs": list(ids), "baseline": ids[0],
            # what changed between the receipts (with more than two runs, each names the run it is of)
            "differences": [d for ds in diffs for d in ds] if len(diffs) == 1 else
            [{**d, "run": r.id} for r, ds in zip(runs[1:], diffs) for d in ds],
            "invalid": [r.invalid for r in runs], "spec": spec, "metrics": metrics}


def _apart(a: RunRecord, b: RunRecord, diffs: list[dict[str, Any]]) -> str | None:
    for run in (a, b):
        if run.invalid:
            return f"run {run.id} is invalid: {run.invalid}"
    matter = [d for d in diffs if d["matters"]]
    if matter:
        return f"{matter[0]['matters']} differs ({receipts.line(matter[0])})"
    return None


def _verdict(name: str, a: list[float], b: list[float], apart: str | None) -> tuple[str, str]:
    if apart is not None:
        return "incomparable", apart
    return noise.verdict(a, b, metricinfo.direction(name))


def with_previous(store: Store, run_id: int | None) -> list[int]:
    """[the previous run, the run]: the one of the same playbook on the same host just before it (the run
    is the newest one when none is given) — "against last time"."""
    if run_id is None:
        newest = store.list_runs(limit=1)
        if not newest:
            raise UsageError("no runs to compare")
        run = newest[0]
    else:
        run = store.get_run(run_id)
    before = store.previous_run(run)
    if before is None:
        raise UsageError(f"run {run.id} is the first run of {run.playbook} on {run.host}: nothing before it")
    return [before.id, run.id]


def _ordered_union(dicts: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for d in dicts:
        seen.update(dict.fromkeys(d))
    return list(seen)


# --- sweep report: an HTML page with PNG charts, built from the database ---------------------------

MAX_BAR_CHARTS = 6
MAX_SERIES_CHARTS = 4
MAX_NIGHTS = 30


def _swept_label(diff: dict[str, Any]) -> str:
    return " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in diff.items()) or "base spec"


def sweep_points(store: Store, sweep_id: int) -> list[dict[str, Any]]:
    """The points of a sweep in the order they were first run, each its latest run (a retry replaces the
    attempt before it) with its flattened spec, swept values and latest metrics."""
    if "sweep_id" not in store.run_columns():
        raise UsageError("this database records no sweeps")
    ids = stored_sweeps.run_ids(store, sweep_id)
    if not ids:
        raise UsageError(f"no runs in sweep {sweep_id!r}")
    latest: dict[str, int] = {}  # point -> its latest run; a dict keeps the order points first ran in
    for run_id in ids:
        run = store.get_run(run_id)
        latest[run.point if run.point is not None else f"run {run_id}"] = run_id
    points: list[dict[str, Any]] = []
    for run_id in latest.values():
        run = store.get_run(run_id)
        points.append({"run": run, "spec": flatten(run.spec), "diff": run.point_diff,
                       "metrics": store.latest_metrics(run_id)})
    specs: list[dict[str, Any]] = [p["spec"] for p in points]
    differ = [k for k in _ordered_union(specs) if any(s.get(k) != specs[0].get(k) for s in specs[1:])]
    for p, spec in zip(points, specs):  # without a recorded point: the spec keys that differ are its swept values
        p["label"] = _swept_label(p["diff"] if p["diff"] is not None else {k: spec.get(k) for k in differ})
    return points


def best_point(points: list[dict[str, Any]], metric: str | Objective) -> int | None:
    """Index of the best point by the objective (a bare metric: in its own direction)."""
    objective = metric if isinstance(metric, Objective) else Objective.of_metric(metric)
    found = best(objective, ((i, p["metrics"]) for i, p in enumerate(points) if not p["run"].invalid))
    return None if found is None else int(found[0])


def nights(store: Store, row: dict[str, Any], objective: Objective) -> list[dict[str, Any]]:
    """The sweeps of the same file (name and content), one per instance — a nightly entry's nights —
    oldest first: each with every point's value of the objective and its best."""
    found = []
    ids = stored_sweeps.of_file(store, row["name"], row["file_hash"])
    for sweep_id in ids[-MAX_NIGHTS:]:
        other = stored_sweeps.sweep(store, sweep_id)
        try:
            points = sweep_points(store, sweep_id)
        except UsageError:
            continue  # a night that ran nothing
        values = {p["label"]: p["metrics"][objective.metric] for p in points
                  if p["run"].status is Status.SUCCEEDED and not p["run"].invalid and objective.metric in p["metrics"]}
        top = best(objective, ((label, {objective.metric: v}) for label, v in values.items()))
        # each point's noise band that night: the range of its samples (its repeats, a server's steady state)
        bands = {}
        for p in points:
            if p["label"] in values:
                kept = judged(objective.metric, store.metric_values(p["run"].id).get(objective.metric, []))
                if len(kept) > 1:
                    bands[p["label"]] = [min(kept), max(kept)]
        found.append({"sweep_id": sweep_id, "night": _night(other), "values": values, "bands": bands,
                      "best": None if top is None else {"label": top[0], "value": top[1]}})
    return found


def _night(row: dict[str, Any] | None) -> str:
    if row is None:
        return "?"
    return row["instance"] or time.strftime("%Y-%m-%d", time.localtime(row["created_at"]))


def sweep_report(store: Store, sweep_id: int, out_dir: Any, metric: str | None = None,
                 charts: list[str] | None = None, series: list[str] | None = None) -> Any:
    """Write `report.html` and its PNG charts into out_dir; returns the page's path.

    The best point is the sweep file's objective's (or, with `metric`, that metric's: latencies lower,
    others higher); charts: metrics drawn per point, labelled by the swept values (default: all, up to
    six); series: metrics drawn over time within each run (default: those sampled more than once). A
    sweep of a file that ran on earlier nights gets a trend of the objective across them.
    """
    from pathlib import Path

    points = sweep_points(store, sweep_id)
    # the playbook's headlines first, then the rest by name
    names = metricinfo.order(_ordered_union([p["metrics"] for p in points]), points[0]["run"].playbook if points else None)
    row = stored_sweeps.sweep(store, sweep_id)  # None: a database from before sweeps were recorded
    objective = of_doc(row["doc"]) if row else None
    if metric is not None:
        if metric not in names:
            raise UsageError(f"no metric {metric!r} in sweep {sweep_id} (known: {', '.join(names) or 'none'})")
        if metricinfo.is_count(metric):
            raise UsageError(f"{metric!r} is a count or a setting, never an objective; "
                             f"one of: {', '.join(n for n in names if metricinfo.direction(n)) or 'none'}")
        objective = Objective.of_metric(metric)
    # the best of the points that succeeded: a failed run's last figures are not a result
    ok = [(i, p["metrics"]) for i, p in enumerate(points) if p["run"].status is Status.SUCCEEDED and not p["run"].invalid]
    found = best(objective, ok) if objective else None
    best_i = None if found is None else int(found[0])
    searched = _search_doc(store, sweep_id) if row and (row["doc"] or {}).get("search") else None
    if searched is not None:  # a search's trial states; its best is a feasible point's, never a pruned one's
        states = {p["run_id"]: p["status"] + (f": {p['cause']}" if p.get("cause") else "")
                  for p in searched["points"] if p["run_id"]}
        for p in points:
            p["trial"] = states.get(p["run"].id)
        if metric is None:
            run_id = searched["best"]["run_id"] if searched["best"] else None
            best_i = next((i for i, p in enumerate(points) if p["run"].id == run_id), None)
    keys = [k for k in _ordered_union([p["spec"] for p in points])
            if any(p["spec"].get(k) != points[0]["spec"].get(k) for p in points[1:])]
    if charts is None:  # the objective's chart first, then the headlines; a count or setting is no result
        first = [objective.metric] if objective and objective.metric in names else []
        charts = [*first, *(n for n in names if n not in first and metricinfo.direction(n))][:MAX_BAR_CHARTS]
    if series is None:
        series = [n for n in names if any(store.count_samples(p["run"].id, n) > 1 for p in points)]
        series = series[:MAX_SERIES_CHARTS]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trend = nights(store, row, objective) if row and objective else []
    images = []
    if charts:
        images.append(_bar_charts(points, charts, objective, best_i, out / "metrics.png"))
    if len(trend) > 1 and objective:
        images.append(_trend_chart(trend, objective, out / "trend.png"))
    if series:
        images.append(_series_charts(store, points, series, out / "series.png"))
    if searched is not None and searched["search"]["history"]:
        images.append(_search_chart(searched, out / "search.png"))
    logs_root = Path(store.path).parent
    links = [os.path.relpath(logs_root / str(p["run"].id) / "log.tail", out) for p in points]
    page = out / "report.html"
    page.write_text(_html(_title(store, sweep_id, row, points), points, keys, names, objective, best_i, images,
                          links, trend, _search_lines(searched)))
    return page


def _search_doc(store: Store, sweep_id: int) -> dict[str, Any]:
    from .. import sweep

    return sweep.document(store, sweep_id)


def _search_lines(doc: dict[str, Any] | None) -> list[str]:
    from .. import sweep

    return sweep.search_lines(doc) if doc else []


def _search_chart(doc: dict[str, Any], path: Any) -> str:
    """The objective trial by trial (pruned and infeasible trials marked apart) and the best so far."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.4))
    history = doc["search"]["history"]
    for status, marker in (("succeeded", "o"), ("pruned", "x"), ("infeasible", "s")):
        got = [h for h in history if h["status"] == status and h["objective"] is not None]
        ax.scatter([h["index"] for h in got], [h["objective"] for h in got], marker=marker, label=status, alpha=0.8)
    best = [h for h in history if h["best"] is not None]
    ax.step([h["index"] for h in best], [h["best"] for h in best], where="post", color=BEST_COLOR, linewidth=2,
            label="best so far")
    ax.set_xlabel("trial")
    ax.set_title(f"{doc['objective']['metric']} by trial", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path.name)


def _title(store: Store, sweep_id: int, row: dict[str, Any] | None, points: list[dict[str, Any]]) -> str:
    hosts = ", ".join(dict.fromkeys(p["run"].host for p in points))
    if row is None:
        return f"Sweep {sweep_id} on {hosts}"
    return f"{row['name']} — {_night(row)} — sweep {sweep_id} on {hosts}"


def _pyplot() -> Any:
    # Imported here only: matplotlib costs a second of start-up that `orch status` must not pay.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


BEST_COLOR, OTHER_COLOR = "#2b8a3e", "#4c6ef5"


def _bar_charts(points: list[dict[str, Any]], names: list[str], objective: Objective | None, best_i: int | None,
                path: Any) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.9 * len(names)), squeeze=False)
    labels = [p["label"].replace(" ", "\n") for p in points]  # the swept values, one per line
    for ax, name in zip(axes[:, 0], names):
        values = [p["metrics"].get(name) for p in points]
        mine = best_i if objective is not None and name == objective.metric else None  # best: by the objective only
        colors = [BEST_COLOR if i == mine else OTHER_COLOR for i in range(len(points))]
        shown = [float("nan") if v is None else v for v in values]  # a point without the metric: no bar
        bars = ax.bar(range(len(points)), shown, color=colors)
        ax.bar_label(bars, labels=["" if v is None else f"{v:g}" for v in values], fontsize=7, padding=2)
        ax.set_xticks(range(len(points)), labels)
        zoomed = _zoom(ax, [v for v in values if v is not None])
        way = (("lower" if objective.goal == "min" else "higher") if objective is not None and name == objective.metric
               else metricinfo.direction(name))
        title = f"{name} ({way} is better)" if way else f"{name} (a count or setting, not an objective)"
        if objective is not None and name == objective.metric:
            title += " — the objective; best in green"
        if zoomed:
            title += " — axis zoomed to the values"
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path.name)


ZOOM_BELOW = 0.5  # zoom when the values span less than this share of the largest: bars from 0 would hide it


def _zoom(ax: Any, values: list[float]) -> bool:
    """The axis around the values rather than from 0, so a 4 % difference shows; True when zoomed."""
    if not values:
        return False
    lo, hi = min(values), max(values)
    if lo <= 0 or (hi - lo) >= ZOOM_BELOW * hi:
        return False
    pad = (hi - lo) * 0.25 or hi * 0.02
    ax.set_ylim(max(lo - pad, 0.0), hi + pad)
    return True


def _band(night: dict[str, Any]) -> str:
    """The best point's noise that night (the range of its samples): a move inside it is no regression."""
    band = night["bands"].get(night["best"]["label"]) if night["best"] else None
    return f"{band[0]:.4g} – {band[1]:.4g}" if band else "-"


def _trend_chart(trend: list[dict[str, Any]], objective: Objective, path: Any) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.4))
    x = list(range(len(trend)))
    labels = list(dict.fromkeys(label for night in trend for label in night["values"]))
    for label in labels:
        ys = [night["values"].get(label) for night in trend]
        line = ax.plot([i for i, y in zip(x, ys) if y is not None], [y for y in ys if y is not None], marker=".",
                       linewidth=1, alpha=0.6, label=label)[0]
        band = [(i, night.get("bands", {}).get(label)) for i, night in zip(x, trend)]
        band = [(i, b) for i, b in band if b]
        if band:  # the point's noise each night: a difference inside it is no regression
            ax.fill_between([i for i, _ in band], [b[0] for _, b in band], [b[1] for _, b in band],
                            color=line.get_color(), alpha=0.15, linewidth=0)
    bx = [i for i, n in zip(x, trend) if n["best"]]
    ax.plot(bx, [trend[i]["best"]["value"] for i in bx], color=BEST_COLOR, marker="*", markersize=12, linewidth=3,
            label="best of the night")
    ax.set_xticks(x, [n["night"] for n in trend])
    ax.set_title(f"{objective.metric} across nights ({'higher' if objective.goal == 'max' else 'lower'} is better)",
                 fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path.name)


def _series_charts(store: Store, points: list[dict[str, Any]], names: list[str], path: Any) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.8 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for p in points:
            samples = store.metric_series(p["run"].id, name)
            if not samples:
                continue
            t0 = p["run"].started_at or samples[0][0]
            ax.plot([ts - t0 for ts, _, _ in samples], [v for _, v, _ in samples], marker=".", label=p["label"])
        ax.set_title(f"{name} during each run", fontsize=10)
        ax.set_xlabel("seconds since start", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path.name)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return html.escape(value if isinstance(value, str) else json.dumps(value))


def _html(title: str, points: list[dict[str, Any]], keys: list[str], names: list[str], objective: Objective | None,
          best_i: int | None, images: list[str], links: list[str], trend: list[dict[str, Any]],
          found: list[str] | None = None) -> str:
    if objective is not None and objective.metric in names:  # the value that decides comes first
        names = [objective.metric, *(n for n in names if n != objective.metric)]
    head = ["point", "run", "status", *keys, *names, "log"]
    rows = []
    for i, p in enumerate(points):
        run = p["run"]
        cells = [html.escape(p["label"]) + (" &#9733; best" if i == best_i else ""), str(run.id),
                 _cell(p.get("trial") or run.status.value)]
        cells += [_cell(p["spec"].get(k)) for k in keys]
        cells += [_cell(p["metrics"].get(n)) for n in names]
        cells.append(f'<a href="{html.escape(links[i])}">log</a>')
        rows.append(f"<tr{' class=best' if i == best_i else ''}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    if objective and best_i is not None:
        verdict = (f"Best point: {html.escape(points[best_i]['label'])} (run {points[best_i]['run'].id}) by "
                   f"{html.escape(objective.metric)} ({'lower' if objective.goal == 'min' else 'higher'} is better).")
    elif objective:
        verdict = f"No succeeded point recorded {html.escape(objective.metric)}."
    else:
        verdict = "No objective: give the sweep file an objective = {metric = ..., goal = ...} (or --metric)."
    nights_table = ""
    if len(trend) > 1 and objective:
        night_rows = "".join(
            f"<tr><td>{html.escape(n['night'])}</td><td>{n['sweep_id']}</td>"
            f"<td>{html.escape(n['best']['label']) if n['best'] else '-'}</td>"
            f"<td>{_cell(n['best']['value']) if n['best'] else '-'}</td><td>{_band(n)}</td></tr>" for n in trend)
        nights_table = (f"<h2>Nights of this sweep file</h2><table><tr><th>night</th><th>sweep</th><th>best point</th>"
                        f"<th>{html.escape(objective.metric)}</th><th>its noise band</th></tr>{night_rows}</table>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; max-width: 1232px; }}
table {{ border-collapse: collapse; margin: 12px 0; max-width: 100%; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 6px; text-align: right; }}
th {{ font-size: 12px; overflow-wrap: anywhere; }}  /* long metric names wrap: the table fits the page */
th {{ background: #e7f5ff; }}
tr.best td {{ background: #d3f9d8; font-weight: bold; }}
img {{ display: block; margin: 16px 0; max-width: 100%; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{len(points)} points. {verdict}</p>
{''.join(f"<p>{html.escape(line)}</p>" for line in found or [])}
<table><tr>{''.join(f'<th>{html.escape(h)}</th>' for h in head)}</tr>
{chr(10).join(rows)}
</table>
{nights_table}
{''.join(f'<img src="{html.escape(name)}" alt="{html.escape(name)}">' for name in images)}
</body></html>
"""
