"""Commands on runs: run, watch, status, logs, cancel, stop."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from ..errors import OrchError
from ..record import Run, Status
from ..store import run_document
from ..workspace import LOCAL
from .app import app, inventory, open_store, parse_run_id, workspace
from .render import age, emit_json, err, out, progress_line


@app.command()
def run(
    playbook: str = typer.Argument(..., help="command, extract-hidden-states, serve-eagle3, bench-serving"),
    host: str = typer.Option(LOCAL, "--host", "-H"),
    file: Path | None = typer.Option(None, "--file", "-f", help="spec TOML"),
    sets: list[str] = typer.Option([], "--set", help="key=value (value parsed as a TOML literal)"),
    detach: bool = typer.Option(False, "--detach", help="return right after a good launch"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the remote commands instead"),
    until_ready: bool = typer.Option(False, "--until-ready", help="return once the job is ready"),
    queue: bool = typer.Option(False, "--queue", help="wait while the host (or GPU set) is busy"),
) -> None:
    """Run a playbook on a host and watch it to the end."""
    from .. import registry, runflow
    from .. import spec as specmod

    ws = workspace()
    pb = registry.playbook(playbook)
    spec = specmod.load(pb.Spec, file, sets)
    target = inventory(ws).get(host)
    store = open_store(ws)
    if dry_run:
        runflow.dry_run(ws, store, pb, spec, target, out.print)
        return
    waited: list[str] = []

    def on_wait(busy: Exception) -> None:
        if not waited:
            err.print(f"waiting: {busy}".removesuffix("; --queue waits"), markup=False)
            waited.append(str(busy))

    ctx = runflow.start(ws, store, pb, spec, target, queue=queue, on_wait=on_wait)
    err.print(f"run {ctx.run_id}: {pb.name} on {target.name}, pid {ctx.run.pid} in {ctx.paths.root}")
    if detach:
        out.print(ctx.run_id)
        return
    _follow(ctx, until_ready)


@app.command()
def watch(run_id: str = typer.Argument(...), until_ready: bool = typer.Option(False, "--until-ready")) -> None:
    """Resume watching a run (after a detach, Ctrl-C or a dead controller)."""
    from .. import runflow

    ws = workspace()
    ctx = runflow.open_run(ws, open_store(ws), parse_run_id(run_id), inventory(ws))
    _follow(ctx, until_ready)


def _follow(ctx: Any, until_ready: bool) -> None:
    """Watch through the run flow, showing its events and a live progress line; Ctrl-C detaches."""
    from rich.live import Live

    from .. import runflow

    live = Live(console=err, transient=True, refresh_per_second=4)
    seen = len(ctx.store.events(ctx.run_id))

    def show(w: Any) -> None:
        nonlocal seen
        events = ctx.store.events(ctx.run_id)
        for e in events[seen:]:
            if e["kind"] != "status" or e["message"].split(":")[0] in ("running",):
                live.console.print(f"{time.strftime('%H:%M:%S', time.localtime(e['ts']))} {e['kind']}: {e['message']}")
        seen = len(events)
        live.update(progress_line(w.run.progress, w.run.phase))

    try:
        with live:
            final = runflow.watch(ctx, until_ready=until_ready, on_update=show)
    except KeyboardInterrupt:
        ctx.event("detached", "watch interrupted; the job keeps running")
        err.print(f"detached; run {ctx.run_id} keeps running — `orch watch {ctx.run_id}` resumes")
        raise typer.Exit(0)
    _finish(final)


def _finish(run: Run) -> None:
    line = f"run {run.id} {run.status}"
    if run.reason and run.status is not Status.SUCCEEDED:
        line += f": {run.reason}"
    err.print(line)
    raise typer.Exit(0 if run.status in (Status.SUCCEEDED, Status.RUNNING) else 1)


@app.command()
def status(
    run_id: str | None = typer.Argument(None),
    as_json: bool = typer.Option(False, "--json"),
    refresh: bool = typer.Option(False, "--refresh", help="poll the host of every active run once"),
    limit: int = typer.Option(50, "--limit", "-n"),
    timeout: float = typer.Option(30.0, help="seconds per host for --refresh"),
) -> None:
    """Show runs, newest first, or one run in full."""
    ws = workspace()
    store = open_store(ws)
    if refresh:
        from .. import runflow

        runflow.refresh(ws, store, [parse_run_id(run_id)] if run_id else None, timeout,
                        lambda message: err.print(message, markup=False))
    if run_id is not None:
        doc = run_document(store, store.get_run(parse_run_id(run_id)))
        if as_json:
            emit_json(doc)
        else:
            _print_run(doc)
        return
    runs = store.list_runs(limit=limit)
    if as_json:
        emit_json([run_document(store, r, with_events=False) for r in runs])
        return
    table = Table("id", "playbook", "host", "status", "phase", "progress", "metrics", "age", box=None)
    now = time.time()
    for r in runs:
        doc = run_document(store, r, with_events=False)
        p = doc["progress"]
        prog = f"{p['label'] or ''} {p['done']:g}/{p['total']:g}" if p and p.get("total") else ""
        if not p and doc["predicted_ready_at"] and r.status is Status.RUNNING:
            prog = f"loaded in ~{max(0, doc['predicted_ready_at'] - now):.0f}s (history)"
        metrics = " ".join(f"{k}={v:g}" for k, v in list(doc["metrics"].items())[:3])
        status_text = doc["status"] + (" (stalled)" if doc["stalled"] else "")
        table.add_row(str(r.id), r.playbook, r.host, status_text, r.phase or "", prog, metrics,
                      age(now - r.created_at))
    out.print(table)


def _print_run(doc: dict[str, Any]) -> None:
    out.print(f"run {doc['id']} {doc['playbook']} on {doc['host']}: {doc['status']} ({doc['phase']})")
    for key in ("reason", "exit_code", "pid", "remote_dir"):
        if doc.get(key) is not None:
            out.print(f"  {key}: {doc[key]}")
    if doc["progress"]:
        out.print("  progress: " + progress_line(doc["progress"], doc["phase"]))
    if doc["predicted_ready_at"] and doc["phase"] in ("starting", "loading"):
        left = doc["predicted_ready_at"] - time.time()
        out.print(f"  loading should end in ~{max(left, 0):.0f} s (earlier runs of this model here)")
    if doc["stalled"]:
        out.print("  stalled: no progress for longer than usual")
    if doc["error"]:
        e = doc["error"]
        out.print(f"  error: {e['kind']}: {e['exception'] or ''} {e['message']}")
    for k, v in doc["metrics"].items():
        out.print(f"  {k} = {v:g}")
    out.print("  spec: " + json.dumps(doc["spec"]))
    for e in doc["events"]:
        out.print(f"  {time.strftime('%m-%d %H:%M:%S', time.localtime(e['ts']))} {e['kind']}: {e['message']}")


@app.command()
def logs(
    run_id: str = typer.Argument(...),
    lines: int = typer.Option(40, "-n", "--lines"),
    follow: bool = typer.Option(False, "-f", "--follow"),
) -> None:
    """Print the last lines of a run's log (from the host)."""
    from .. import runflow

    ws = workspace()
    store = open_store(ws)
    row = store.get_run(parse_run_id(run_id))
    if not row.remote_dir:
        raise OrchError(f"run {row.id} has no log ({row.status})")
    ctx = runflow.open_run(ws, store, row, inventory(ws))
    sys.stdout.write(runflow.log_tail(ctx, lines))
    sys.stdout.flush()
    if follow:
        def write(data: bytes) -> None:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()

        runflow.follow_log(ctx, write)


@app.command()
def cancel(run_id: str = typer.Argument(...),
           grace: float = typer.Option(10.0, help="seconds between SIGTERM and SIGKILL")) -> None:
    """Kill a run's process group; its status becomes cancelled."""
    from .. import runflow

    ws = workspace()
    ctx = runflow.open_run(ws, open_store(ws), parse_run_id(run_id), inventory(ws))
    outcome = runflow.cancel(ctx, "cancelled by user", grace)
    err.print(f"run {ctx.run_id} cancelled ({outcome})")


@app.command("stop")
def stop_cmd(run_id: str = typer.Argument(...),
             grace: float = typer.Option(10.0, help="seconds between SIGTERM and SIGKILL")) -> None:
    """End a run (a server): stop its process group, mark it cancelled, wait until its GPUs are free."""
    from .. import runflow

    ws = workspace()
    ctx = runflow.open_run(ws, open_store(ws), parse_run_id(run_id), inventory(ws))
    err.print(f"run {ctx.run_id} stopped: {runflow.stop(ctx, grace)}")
