"""Reports over recorded runs: specs and metrics side by side, ratios against the first run."""

from __future__ import annotations

from typing import Any

from .errors import UsageError
from .store import Store

RATIO_DIGITS = 4


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested spec tables as dotted keys (`env.NCCL_DEBUG`), so one changed variable is one row."""
    if isinstance(value, dict) and (value or not prefix):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: value}


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or base == 0:
        return None
    return round(value / base, RATIO_DIGITS)


def compare(store: Store, ids: list[int], all_keys: bool = False, baseline: int | None = None) -> dict[str, Any]:
    """Specs (only the keys that differ unless `all_keys`) and latest metrics of runs, in the order given.

    A key or metric a run lacks is None for it; ratios are each run's value over the first run's, which
    is the baseline run when one is given (it comes first, whether or not it is among `ids`).
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
    metrics: dict[str, dict[str, list[float | None]]] = {}
    for name in sorted(_ordered_union(latest)):
        values = [m.get(name) for m in latest]
        metrics[name] = {"values": values, "ratios": [ratio(v, values[0]) for v in values]}
    return {"runs": list(ids), "baseline": ids[0], "spec": spec, "metrics": metrics}


def _ordered_union(dicts: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for d in dicts:
        seen.update(dict.fromkeys(d))
    return list(seen)


# --- sweep report: an HTML page with PNG charts, built from the database ---------------------------

MAX_BAR_CHARTS = 6
MAX_SERIES_CHARTS = 4


def lower_is_better(metric: str) -> bool:
    """Latencies (`*_ms`) improve downwards; everything else (throughput, acceptance) upwards."""
    return metric.endswith("_ms")


def sweep_points(store: Store, sweep_id: int) -> list[dict[str, Any]]:
    """The runs of a sweep, oldest first, each with its flattened spec and latest metrics."""
    cols = {r[1] for r in store.conn.execute("PRAGMA table_info(runs)")}
    if "sweep_id" not in cols:
        raise UsageError("this database records no sweeps")
    ids = [r[0] for r in store.conn.execute("SELECT id FROM runs WHERE sweep_id = ? ORDER BY id", (sweep_id,))]
    if not ids:
        raise UsageError(f"no runs in sweep {sweep_id!r}")
    points = []
    for run_id in ids:
        run = store.get_run(run_id)
        points.append({"run": run, "spec": flatten(run.spec), "metrics": store.latest_metrics(run_id)})
    return points


def best_point(points: list[dict[str, Any]], metric: str) -> int | None:
    """Index of the best point by `metric` (None when no point has it)."""
    scored = [(p["metrics"][metric], i) for i, p in enumerate(points) if metric in p["metrics"]]
    if not scored:
        return None
    return (min if lower_is_better(metric) else max)(scored)[1]


def sweep_report(store: Store, sweep_id: int, out_dir: Any, metric: str | None = None,
                 charts: list[str] | None = None, series: list[str] | None = None) -> Any:
    """Write `report.html` and its PNG charts into out_dir; returns the page's path.

    metric: the one that picks the best point (default: the first metric found); charts: metrics drawn
    per point (default: all, up to six); series: metrics drawn over time within each run (default: those
    sampled more than once).
    """
    from pathlib import Path

    points = sweep_points(store, sweep_id)
    names = _ordered_union([p["metrics"] for p in points])
    if metric is not None and metric not in names:
        raise UsageError(f"no metric {metric!r} in sweep {sweep_id} (known: {', '.join(names) or 'none'})")
    metric = metric or (names[0] if names else None)
    best = best_point(points, metric) if metric else None
    specs = [p["spec"] for p in points]
    keys = [k for k in _ordered_union(specs) if any(s.get(k) != specs[0].get(k) for s in specs[1:])]
    charts = charts if charts is not None else names[:MAX_BAR_CHARTS]
    if series is None:
        series = [n for n in names if any(_samples(store, p["run"].id, n) > 1 for p in points)]
        series = series[:MAX_SERIES_CHARTS]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = []
    if charts:
        images.append(_bar_charts(points, charts, best, out / "metrics.png"))
    if series:
        images.append(_series_charts(store, points, series, out / "series.png"))
    page = out / "report.html"
    page.write_text(_html(sweep_id, points, keys, names, metric, best, images))
    return page


def _samples(store: Store, run_id: int, name: str) -> int:
    row = store.conn.execute("SELECT COUNT(*) FROM metrics WHERE run_id = ? AND name = ?", (run_id, name))
    return int(row.fetchone()[0])


def _label(point: dict[str, Any]) -> str:
    return f"run {point['run'].id}"


def _pyplot() -> Any:
    # Imported here only: matplotlib costs a second of start-up that `orch status` must not pay.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bar_charts(points: list[dict[str, Any]], names: list[str], best: int | None, path: Any) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.6 * len(names)), squeeze=False)
    labels = [_label(p) for p in points]
    for ax, name in zip(axes[:, 0], names):
        values = [p["metrics"].get(name, 0.0) for p in points]
        mine = best_point(points, name)
        colors = ["#2b8a3e" if i == mine else "#4c6ef5" for i in range(len(points))]
        ax.bar(labels, values, color=colors)
        ax.set_title(f"{name} ({'lower' if lower_is_better(name) else 'higher'} is better)", fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path.name


def _series_charts(store: Store, points: list[dict[str, Any]], names: list[str], path: Any) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 2.8 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for p in points:
            samples = store.metric_series(p["run"].id, name)
            if not samples:
                continue
            t0 = p["run"].started_at or samples[0][0]
            ax.plot([ts - t0 for ts, _, _ in samples], [v for _, v, _ in samples], marker=".", label=_label(p))
        ax.set_title(f"{name} during each run", fontsize=10)
        ax.set_xlabel("seconds since start", fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path.name


def _cell(value: Any) -> str:
    import html
    import json

    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    return html.escape(value if isinstance(value, str) else json.dumps(value))


def _html(sweep_id: int, points: list[dict[str, Any]], keys: list[str], names: list[str], metric: str | None,
          best: int | None, images: list[str]) -> str:
    import html

    head = ["run", "status", *keys, *names]
    rows = []
    for i, p in enumerate(points):
        run = p["run"]
        cells = [f"{run.id}" + (" &#9733; best" if i == best else ""), _cell(run.status.value)]
        cells += [_cell(p["spec"].get(k)) for k in keys]
        cells += [_cell(p["metrics"].get(n)) for n in names]
        rows.append(f"<tr{' class=best' if i == best else ''}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    if metric and best is not None:
        verdict = (f"Best point: run {points[best]['run'].id} by {html.escape(metric)} "
                   f"({'lower' if lower_is_better(metric) else 'higher'} is better).")
    else:
        verdict = "No metrics recorded."
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>sweep {html.escape(str(sweep_id))}</title>
<style>
body {{ font-family: sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 12px 0; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: right; }}
th {{ background: #e7f5ff; }}
tr.best td {{ background: #d3f9d8; font-weight: bold; }}
img {{ display: block; margin: 16px 0; max-width: 100%; }}
</style></head><body>
<h1>Sweep {html.escape(str(sweep_id))}</h1>
<p>{len(points)} points. {verdict}</p>
<table><tr>{''.join(f'<th>{html.escape(h)}</th>' for h in head)}</tr>
{chr(10).join(rows)}
</table>
{''.join(f'<img src="{html.escape(name)}" alt="{html.escape(name)}">' for name in images)}
</body></html>
"""
