"""Looking back: inspect-log (what orch reads in any log) and compare (runs side by side)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..errors import UsageError
from ..store import receipts, shapes, summaries
from .app import app, parse_run_id, read_store, workspace
from .render import BETTER, WORSE, Styled, emit_json, out, progress_line, table


@app.command("inspect-log")
def inspect_log(path: Path = typer.Argument(..., help="any log file, of any size"),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """What orch reads in a log: engine, phase, progress, the error that ended it, metrics."""
    from ..logparse import inspect_file

    if not path.is_file():
        raise UsageError(f"no such log file: {path}")
    try:
        samples: list[tuple[str, float]] = []
        found = inspect_file(path, samples=samples)  # one read gives the reading and every metric sample
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    # per metric: last, and mean and p50 over the steady state (the first 10 % of samples left out)
    found["metric_summaries"] = {k: {f: shapes.number(v) for f, v in s.items()}
                                 for k, s in summaries.summaries(samples).items()}
    e = found["error"]
    found["error"] = ({k: e.get(k) for k in ("kind", "exception", "message", "line", "fatal", "chain", "hint")}
                      if e else None)
    found["progress"], found["metrics"] = shapes.progress(found["progress"]), shapes.metrics(found["metrics"])
    if as_json:
        emit_json(found)
        return
    out.print(f"engine: {found['engine']}  phase: {found['phase']}", markup=False)
    if found["progress"]:
        out.print("progress: " + progress_line(found["progress"], found["phase"]))
    if e:
        out.print(f"error (line {e['line']}): {e['kind']}: {e['exception'] or ''} {e['message']}".rstrip(),
                  markup=False)
        if e.get("hint"):
            out.print(f"hint: {e['hint']}", markup=False)
    if found["metrics"]:
        out.print("metrics: " + " ".join(f"{k}={v:g}" for k, v in found["metrics"].items()), markup=False)
    for name, s in found["metric_summaries"].items():
        out.print(f"  {summaries.line(name, s)}", markup=False)


@app.command()
def compare(
    run_ids: list[str] = typer.Argument(None, help="two or more run ids; ratios are against the first"),
    as_json: bool = typer.Option(False, "--json"),
    all_keys: bool = typer.Option(False, "--all", help="every spec key, not only those that differ"),
    baseline: str | None = typer.Option(None, "--baseline", metavar="ID", help="the run the others are measured against"),
    previous: bool = typer.Option(False, "--previous",
                                  help="one run (default: the newest) against the run of its playbook on its host "
                                       "before it"),
    metric: list[str] = typer.Option(None, "--metric", metavar="NAME", help="only this metric (repeatable)"),
) -> None:
    """What differs between the runs' receipts, then each metric with its verdict against the first run (or
    the baseline): better, worse, within_noise or incomparable, judged from each run's spread."""
    from ..ui import report

    store = read_store(workspace())
    ids = [parse_run_id(r) for r in run_ids or []]
    base = parse_run_id(baseline) if baseline is not None else None
    if previous:
        if len(ids) > 1 or base is not None:
            raise UsageError("--previous takes one run (or none: the newest) and no --baseline")
        ids = report.with_previous(store, ids[0] if ids else None)
    found = report.compare(store, ids, all_keys, base, metric or None)
    if as_json:
        emit_json(found)
        return
    for d in found["differences"]:  # first: what changed, as the receipts say
        out.print(("" if "run" not in d else f"run {d['run']}: ") + receipts.line(d)
                  + (f"  (incomparable: {d['matters']})" if d["matters"] else ""), markup=False)
    for run_id, why in zip(found["runs"], found["invalid"]):
        if why:
            out.print(f"run {run_id} is invalid: {why}", markup=False)
    rows = [[key, *("-" if v is None else v if isinstance(v, str) else json.dumps(v) for v in values)]
            for key, values in found["spec"].items()]
    for name, m in found["metrics"].items():
        cells = []
        for i, (v, r, better) in enumerate(zip(m["values"], m["ratios"], m["better"])):
            cell = "-" if v is None else f"{v:g}"
            if i and base is not None and v is not None and m["values"][0] is not None:
                cell = f"{m['values'][0]:g} → {cell}"  # against the baseline, as people write it
            cell += f" ({r:.2f}x)" if i and r is not None else ""
            verdict = m["verdicts"][i]
            style = {"better": BETTER, "worse": WORSE}.get(verdict or "")
            cells.append(Styled(cell + (f" {verdict}" if verdict else ""), style))
        rows.append([name + (" *" if m["headline"] else ""), *cells])  # coloured by the verdict, not the last sample
        # the steady state (the first 10 % left out) and its range: what the verdict weighs
        rows.append(["  mean / p50 [min, max]", *("-" if s is None else
                                                  f"{s['mean']:.4g} / {s['p50']:.4g} [{s['min']:.4g}, {s['max']:.4g}]"
                                                  for s in m["summaries"])])
    first = " (baseline)" if base is not None else " (previous)" if previous else ""
    table(["", *(f"run {i}" + ("" if n else first) for n, i in enumerate(found["runs"]))], rows)
