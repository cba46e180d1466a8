"""Many runs: orch sweep (run, status, watch, cancel, report) and orch cron (nightly sweeps)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from ..store.record import KILL_GRACE_S
from .app import app, no_runs_note, open_store, read_store, workspace
from .render import age, emit_json, err, out, table

sweep_app = typer.Typer(help="Grids of runs over hosts: run (or resume), status, cancel.", no_args_is_help=True)
app.add_typer(sweep_app, name="sweep")


@sweep_app.command("run")
def sweep_run(file: Path = typer.Argument(..., help="sweep file (TOML)"),
              detach: bool = typer.Option(False, "--detach", help="run the controller in the background"),
              instance: str = typer.Option(
                  "", "--instance", help="which run of this file (e.g. a date); another instance is a new sweep"),
              as_json: bool = typer.Option(False, "--json", help="the sweep at its end (as `sweep status ID --json`)"),
              ) -> None:
    """Run every point of a sweep; the same file (and instance) again resumes it."""
    from .. import sweep

    ws = workspace()
    if detach:
        sweep_id, log = sweep.detach(ws, file, instance)
        err.print(f"sweep {sweep_id} runs in the background; log: {log}", markup=False)
        emit_json({"id": sweep_id, "log": str(log)}) if as_json else out.print(sweep_id)
        return
    doc = sweep.run(ws, file, echo=lambda line: err.print(line, markup=False), instance=instance)
    if as_json:
        emit_json(sweep.document(open_store(ws), doc["id"]))
    counts = ", ".join(f"{n} {s}" for s, n in sorted(doc["counts"].items()))
    err.print(f"sweep {doc['id']} ({doc['name']}) {doc['status']}: {counts}", markup=False)
    final = sweep.document(open_store(ws), doc["id"])
    for line in sweep.search_lines(final):
        err.print(line, markup=False, soft_wrap=True)
    verdict = sweep.best_line(final)
    if verdict:
        err.print(verdict, markup=False)
    raise typer.Exit(0 if doc["status"] == "succeeded" else 1)


@sweep_app.command("status")
def sweep_status(ref: str | None = typer.Argument(None, metavar="[SWEEP]", help="id or name"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Sweeps, newest first, or one sweep point by point."""
    from .. import sweep

    ws = workspace()
    store = read_store(ws)
    if ref is None:
        docs = sweep.list_sweeps(store)
        if not docs:
            no_runs_note(ws)
        if as_json:
            emit_json(docs)
            return
        table(["id", "name", "instance", "playbook", "status", "points", "age"],
              [[d["id"], d["name"], d["instance"], d["playbook"], d["status"],
                " ".join(f"{n} {s}" for s, n in sorted(d["counts"].items())), age(time.time() - d["created_at"])]
               for d in docs])
        return
    doc = sweep.document(store, sweep.resolve(store, ref), with_events=as_json)
    if as_json:
        emit_json(doc)
        return
    title = f"{doc['name']} {doc['instance']}" if doc["instance"] else doc["name"]
    objective = doc["objective"]["metric"] if doc["objective"] else None
    best = doc["best"]["index"] if doc["best"] else None
    rows = []
    for p in doc["points"]:
        others = [(k, v) for k, v in p["metrics"].items() if k != objective]
        metrics = " ".join(f"{k}={v:g}" for k, v in others[:3])
        row = [f"{p['index']}{' *' if p['index'] == best else ''}", sweep.label(p["point"]),
               p["host"] + (f":{p['gpus']}" if p["gpus"] else ""), p["status"], p["run_id"], p["attempts"]]
        if objective:  # the value that decides comes before the others, then its steady state
            row.append("-" if p["objective"] is None else f"{p['objective']:g}")
            s = p["metric_summaries"].get(objective)
            row.append("-" if s is None else f"{s['mean']:.4g} / {s['p50']:.4g}")
        why = f"{p['cause']}: {p['reason']}" if p.get("cause") and not (p["reason"] or "").startswith(p["cause"]) \
            else p["reason"]
        why = f"invalid: {p['invalid']}" if p["invalid"] else why if p["status"] != "succeeded" else ""
        rows.append([*row, metrics, why or ""])
    # mean / p50: over the steady state, the first 10 % of the objective's samples left out
    headers = ["#", "point", "host", "status", "run", "tries", *([objective, "mean / p50"] if objective else []),
               "metrics", "reason"]
    table(headers, rows, title=f"sweep {doc['id']} {title} ({doc['playbook']}): {doc['status']}")
    for line in sweep.search_lines(doc):
        out.print(line, markup=False, soft_wrap=True)
    verdict = sweep.best_line(doc)
    if verdict:
        out.print(verdict, markup=False)


@sweep_app.command("watch")
def sweep_watch(ref: str = typer.Argument(..., metavar="SWEEP", help="id or name")) -> None:
    """Follow a sweep until it ends: which point runs, its phase and its log's last line (from the record)."""
    from rich.live import Live
    from rich.text import Text

    from .. import sweep

    store = read_store(workspace())
    sweep_id = sweep.resolve(store, ref)
    tty = err.is_terminal
    live = Live(Text(""), console=err, transient=True, refresh_per_second=1, auto_refresh=tty)
    last: dict[str, Any] | None = None

    def show(doc: dict[str, Any]) -> None:
        nonlocal last
        for line in sweep.changes(last, doc):
            live.console.print(f"{time.strftime('%H:%M:%S')} {line}", markup=False)
        last = doc
        if tty:  # the running points, redrawn: their phase and last line move between changes
            live.update(Text("\n".join(sweep.point_line(p) for p in doc["points"] if p["status"] == "running")))

    try:
        with live:
            doc = sweep.follow(store, sweep_id, show)
    except KeyboardInterrupt:
        err.print(f"stopped following; sweep {sweep_id} goes on — `orch sweep status {sweep_id}` shows it",
                  markup=False)
        raise typer.Exit(0) from None
    for line in sweep.search_lines(doc):
        err.print(line, markup=False, soft_wrap=True)
    verdict = sweep.best_line(doc)
    if verdict:
        err.print(verdict, markup=False)
    raise typer.Exit(0 if doc["status"] == "succeeded" else 1)


@sweep_app.command("cancel")
def sweep_cancel(ref: str = typer.Argument(..., metavar="SWEEP", help="id or name"),
                 grace: float = typer.Option(KILL_GRACE_S, metavar="SECONDS", help="seconds between SIGTERM and SIGKILL"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Cancel the queued points and stop the running ones."""
    from .. import sweep

    res = sweep.cancel(workspace(), ref, grace)
    if as_json:
        emit_json(res)
    stopped = ", ".join(f"run {r} ({o})" for r, o in res["stopped"].items()) or "no runs"
    err.print(f"sweep {res['sweep_id']} cancelled: {res['queued_cancelled']} queued point(s), stopped {stopped}",
              markup=False)


@sweep_app.command("report")
def sweep_report(ref: str = typer.Argument(..., metavar="SWEEP", help="id or name"),
                 metric: str | None = typer.Option(None, help="picks the best point (default: the sweep file's objective)"),
                 chart: list[str] = typer.Option([], "--chart", help="metric drawn per point (default: the headlines, then every metric with a direction)"),
                 series: list[str] = typer.Option([], "--series", help="metric drawn over time (default: sampled ones)")) -> None:
    """Write runs/sweeps/<id>/report.html: the points, their spec differences and metrics, charts."""
    from .. import sweep
    from ..ui import report

    ws = workspace()
    store = open_store(ws)
    sweep_id = sweep.resolve(store, ref)
    page = report.sweep_report(store, sweep_id, ws.runs_dir / "sweeps" / str(sweep_id), metric,
                               chart or None, series or None)
    out.print(str(page), markup=False)




cron_app = typer.Typer(help="Nightly sweeps from the user's crontab.", no_args_is_help=True)
app.add_typer(cron_app, name="cron")


@cron_app.command("install")
def cron_install(file: Path = typer.Argument(..., help="sweep file"),
                 at: str = typer.Option(..., "--at", help="cron schedule, e.g. '0 2 * * *'"),
                 as_json: bool = typer.Option(False, "--json"),
                 dry_run: bool = typer.Option(False, "--dry-run", help="print the crontab line, change nothing")) -> None:
    """Run a sweep on a schedule; a night whose previous sweep still runs is skipped."""
    from .. import cron

    entry = cron.install(workspace(), file, at, dry_run=dry_run)
    if as_json:
        emit_json(entry.to_dict())
    elif dry_run:
        out.print(f"{entry.schedule} {entry.command} # orch:{entry.id}", markup=False, soft_wrap=True)
    else:
        out.print(f"cron entry {entry.id}: {entry.schedule} {entry.file} (log {entry.log})", markup=False)


@cron_app.command("list")
def cron_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """orch's entries in the crontab (nothing else there is shown or touched)."""
    from .. import cron

    found = cron.entries()
    if as_json:
        emit_json([e.to_dict() for e in found])
        return
    rows = []
    for e in found:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.next_run)) if e.next_run else "-"
        last = f"{e.last_run['started']}: {e.last_run['result']}" if e.last_run else "never"
        rows.append([e.id, e.schedule, e.file or "?", e.workspace or "?", "yes" if e.enabled else "no", when, last])
    table(["id", "schedule", "sweep", "workspace", "enabled", "next", "last"], rows)


@cron_app.command("remove")
def cron_remove(entry_id: str = typer.Argument(..., metavar="ID")) -> None:
    """Remove one of orch's crontab entries."""
    from .. import cron

    entry = cron.remove(entry_id)
    err.print(f"removed cron entry {entry.id} ({entry.schedule} {entry.file})", markup=False)


@cron_app.command("fire", hidden=True)
def cron_fire(entry_id: str = typer.Argument(..., metavar="ID"), file: Path = typer.Argument(...),
              instance: str | None = typer.Option(
                  None, "--instance", hidden=True, help="the sweep's instance; default: today's local date")) -> None:
    """What the crontab line runs: the sweep under its lock, or a recorded skip."""
    from .. import cron

    raise typer.Exit(cron.fire(workspace(), entry_id, file, instance=instance))


