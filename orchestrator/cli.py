"""The `orch` command: parse, call one library function, format, choose the exit code (in `main`)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from .errors import OrchError, UsageError
from .record import Run, Status
from .store import Store, run_document
from .workspace import LOCAL, Workspace

if TYPE_CHECKING:
    from .hosts import Host, Inventory

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Run and watch large-model experiments.")
# No markup: run output, log lines and error messages are data, and `[rank3]` must print as itself.
out = Console(highlight=False, soft_wrap=True, markup=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)


class State:
    hosts_file: Path | None = None


@app.callback()
def _global(hosts: Path | None = typer.Option(None, "--hosts", help="inventory file (default hosts.toml)")) -> None:
    State.hosts_file = hosts


def workspace() -> Workspace:
    return Workspace.find(State.hosts_file)


def open_store(ws: Workspace) -> Store:
    return Store(ws.db_path)


def inventory(ws: Workspace) -> Inventory:
    from .hosts import Inventory  # pydantic: only for the commands that need hosts

    return Inventory.load(ws.hosts_file, ws.root)


def emit_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def parse_run_id(text: str) -> int:
    # ASCII digits only (isdigit() takes '²' and Arabic-Indic digits), and within SQLite's integers
    if not re.fullmatch(r"[0-9]{1,18}", text):
        raise UsageError(f"not a run id: {text[:40]!a}")
    return int(text)


# run / watch ----------------------------------------------------------------------------------
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
    from . import registry, runflow
    from . import spec as specmod

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
    job = ctx.executor.describe((ctx.run.pid or 0, ctx.run.pid_start or ""))
    err.print(f"run {ctx.run_id}: {pb.name} on {target.name}, {job} in {ctx.paths.root}")
    if detach:
        _hand_over(ctx)
        out.print(ctx.run_id)
        return
    _follow(ctx, until_ready)


def _hand_over(ctx: Any) -> None:
    """This process stops watching the run; a background watcher keeps it (see watching.py)."""
    from . import watching

    ctx.release()
    watching.ensure_watched(ctx.ws, ctx.store, [ctx.run])


@app.command()
def watch(run_id: str = typer.Argument(...), until_ready: bool = typer.Option(False, "--until-ready"),
          background: bool = typer.Option(False, "--background", hidden=True,
                                          help="watch to the end without output (what orch starts for a run)")) -> None:
    """Resume watching a run (after a detach, Ctrl-C or a dead controller)."""
    from . import runflow

    ws = workspace()
    store = open_store(ws)
    ctx = runflow.open_run(ws, store, parse_run_id(run_id), inventory(ws), any_spec=background)
    if background:
        runflow.keep_watching(ctx)
        return
    row = ctx.run
    if row.status.terminal:
        _finish(runflow.finish(ctx))
    if not row.launched:
        raise OrchError(f"run {row.id} never launched ({row.status})")
    _follow(ctx, until_ready)


def _follow(ctx: Any, until_ready: bool) -> None:
    from rich.live import Live

    from . import runflow
    from .liveview import PlainProgress, RunView

    tty = err.is_terminal
    view = RunView(ctx.run)
    # a person at a terminal: the line is drawn anew every second; elsewhere, a plain line now and then
    live = Live(view, console=err, transient=True, refresh_per_second=1, auto_refresh=tty)
    plain = None if tty else PlainProgress(lambda text: err.print(text, markup=False))
    seen = len(ctx.store.events(ctx.run_id))

    def show(run: Run) -> None:
        nonlocal seen
        events = ctx.store.events(ctx.run_id)
        for e in events[seen:]:
            if e["kind"] != "status" or e["message"].split(":")[0] in ("running",):
                live.console.print(f"{time.strftime('%H:%M:%S', time.localtime(e['ts']))} {e['kind']}: {e['message']}")
        seen = len(events)
        view.update(run)
        if plain is not None:
            plain.update(run)

    try:
        with live:
            final = runflow.watch(ctx, until_ready=until_ready, on_update=show, live=tty)
    except KeyboardInterrupt:
        ctx.event("detached", "watch interrupted; the job keeps running")
        _hand_over(ctx)
        err.print(f"detached; run {ctx.run_id} keeps running, watched in the background — "
                  f"`orch watch {ctx.run_id}` follows it again")
        raise typer.Exit(0)
    _finish(final)


def _progress_line(progress: dict[str, Any] | None, phase: str | None) -> str:
    from .liveview import progress_text

    return progress_text(progress, phase)


def _finish(run: Run) -> None:
    line = f"run {run.id} {run.status}"
    if run.reason and run.status is not Status.SUCCEEDED:
        line += f": {run.reason}"
    err.print(line)
    raise typer.Exit(0 if run.status in (Status.SUCCEEDED, Status.RUNNING) else 1)


# status / logs / cancel -----------------------------------------------------------------------
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
        from . import runflow

        runflow.refresh(ws, store, [parse_run_id(run_id)] if run_id else None, timeout,
                        lambda message: err.print(message, markup=False))
    from . import watching

    watching.ensure_watched(ws, store)  # a run whose watcher died gets a new one
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
    table = Table("id", "playbook", "host", "status", "phase", "progress", "metrics", "age", "seen", box=None)
    now = time.time()
    for r in runs:
        doc = run_document(store, r, with_events=False)
        p = doc["progress"]
        prog = f"{p['label'] or ''} {p['done']:g}/{p['total']:g}" if p and p.get("total") else ""
        if not p and doc["predicted_ready_at"] and r.status is Status.RUNNING:
            prog = f"loaded in ~{max(0, doc['predicted_ready_at'] - now):.0f}s (history)"
        metrics = " ".join(f"{k}={v:g}" for k, v in list(doc["metrics"].items())[:3])
        status_text = doc["status"] + (" (stalled)" if doc["stalled"] else "")
        phase = f"{r.phase} ({r.queue_reason})" if r.phase == "queued" and r.queue_reason else r.phase or ""
        # how fresh an active row is: when its watcher last heard from the host
        seen = _age(now - r.heartbeat) + " ago" if r.heartbeat and not r.status.terminal else ""
        table.add_row(str(r.id), r.playbook, r.host, status_text, phase, prog, metrics,
                      _age(now - r.created_at), seen)
    out.print(table)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _print_run(doc: dict[str, Any]) -> None:
    out.print(f"run {doc['id']} {doc['playbook']} on {doc['host']}: {doc['status']} ({doc['phase']})")
    for key in ("reason", "exit_code", "job_id" if doc.get("job_id") else "pid", "node", "queue_reason", "remote_dir"):
        if doc.get(key) is not None:
            out.print(f"  {key}: {doc[key]}")
    if doc["progress"]:
        out.print("  progress: " + _progress_line(doc["progress"], doc["phase"]))
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
    from . import runflow
    from .logparse.text import TerminalText, terminal_safe

    ws = workspace()
    store = open_store(ws)
    row = store.get_run(parse_run_id(run_id))
    if not row.remote_dir:
        raise OrchError(f"run {row.id} has no log ({row.status})")
    ctx = runflow.open_run(ws, store, row, inventory(ws), any_spec=True)
    tty = sys.stdout.isatty()  # a terminal acts on escape sequences in the log; a file or pipe gets it as is
    tail = runflow.log_tail(ctx, lines)
    sys.stdout.write(terminal_safe(tail) if tty else tail)
    sys.stdout.flush()
    if follow:
        screen = TerminalText()

        def write(data: bytes) -> None:
            if tty:
                sys.stdout.write(screen.feed(data))
            else:
                sys.stdout.buffer.write(data)
            sys.stdout.flush()

        runflow.follow_log(ctx, write)


@app.command()
def cancel(run_id: str = typer.Argument(...), grace: float = typer.Option(10.0, help="seconds between SIGTERM and SIGKILL")) -> None:
    """Kill a run's process group; its status becomes cancelled."""
    from . import runflow

    ws = workspace()
    ctx = runflow.open_run(ws, open_store(ws), parse_run_id(run_id), inventory(ws))
    outcome = runflow.cancel(ctx, "cancelled by user", grace)
    err.print(f"run {ctx.run_id} cancelled ({outcome})")


@app.command("stop")
def stop_cmd(run_id: str = typer.Argument(...),
             grace: float = typer.Option(10.0, help="seconds between SIGTERM and SIGKILL")) -> None:
    """End a run (a server): stop its process group, mark it cancelled, wait until its GPUs are free."""
    from . import runflow

    ws = workspace()
    ctx = runflow.open_run(ws, open_store(ws), parse_run_id(run_id), inventory(ws))
    err.print(f"run {ctx.run_id} stopped: {runflow.stop(ctx, grace)}")


# inspect-log / compare ------------------------------------------------------------------------
@app.command("inspect-log")
def inspect_log(path: Path = typer.Argument(..., help="any log file, of any size"),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """What orch reads in a log: engine, phase, progress, the error that ended it, metrics."""
    from .logparse import inspect_file

    if not path.is_file():
        raise UsageError(f"no such log file: {path}")
    try:
        found = inspect_file(path)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from None
    e = found["error"]
    found["error"] = {k: e[k] for k in ("kind", "exception", "message", "line")} if e else None
    if as_json:
        emit_json(found)
        return
    out.print(f"engine: {found['engine']}  phase: {found['phase']}", markup=False)
    if found["progress"]:
        out.print("progress: " + _progress_line(found["progress"], found["phase"]))
    if e:
        out.print(f"error (line {e['line']}): {e['kind']}: {e['exception'] or ''} {e['message']}".rstrip(),
                  markup=False)
    if found["metrics"]:
        out.print("metrics: " + " ".join(f"{k}={v:g}" for k, v in found["metrics"].items()), markup=False)


@app.command()
def compare(
    run_ids: list[str] = typer.Argument(..., help="two or more run ids; ratios are against the first"),
    as_json: bool = typer.Option(False, "--json"),
    all_keys: bool = typer.Option(False, "--all", help="every spec key, not only those that differ"),
) -> None:
    """Specs and metrics of runs side by side, with ratios against the first run."""
    from rich.text import Text

    from . import report

    found = report.compare(open_store(workspace()), [parse_run_id(r) for r in run_ids], all_keys)
    if as_json:
        emit_json(found)
        return
    table = Table("", *(f"run {i}" for i in found["runs"]), box=None)
    for key, values in found["spec"].items():
        # Text cells: a value such as "[bold]" is data, not markup
        table.add_row(key, *(Text("-" if v is None else v if isinstance(v, str) else json.dumps(v)) for v in values))
    if found["spec"] and found["metrics"]:
        table.add_section()
    for name, m in found["metrics"].items():
        cells = []
        for i, (v, r) in enumerate(zip(m["values"], m["ratios"])):
            cell = "-" if v is None else f"{v:g}"
            cells.append(cell + (f" ({r:.2f}x)" if i and r is not None else ""))
        table.add_row(name, *cells)
    out.print(table)


# hosts -----------------------------------------------------------------------------------------
@app.command()
def hosts(
    check: bool = typer.Option(False, "--check", help="connect to every host (in parallel)"),
    as_json: bool = typer.Option(False, "--json"),
    timeout: float = typer.Option(15.0, help="seconds per host for --check"),
) -> None:
    """List the inventory; --check connects to each host."""
    ws = workspace()
    inv = inventory(ws)
    rows: list[dict[str, Any]] = [
        {"name": h.name, "address": h.address or h.name, "user": h.user, "port": h.port, "gpus": h.gpus,
         "tags": h.tags, "workdir": h.workdir} for h in inv.hosts.values()]
    if check:
        from . import fleet

        found = fleet.check(list(inv.hosts.values()), timeout)
        for row in rows:
            row.update(found[row["name"]])
    if as_json:
        emit_json(rows)
    else:
        cols = ["name", "address", "gpus", "tags"] + (["ok", "uname", "error"] if check else [])
        table = Table(*cols, box=None)
        for r in rows:
            table.add_row(*[_cell(r.get(c)) for c in cols])
        out.print(table)
    if check and not all(r["ok"] for r in rows):
        raise typer.Exit(1)


@app.command()
def gpus(
    host: list[str] = typer.Option([], "--host", "-H", help="hosts to ask (default: local)"),
    all_hosts: bool = typer.Option(False, "--all", help="every host of the inventory"),
    as_json: bool = typer.Option(False, "--json"),
    timeout: float = typer.Option(30.0, help="seconds per host"),
) -> None:
    """GPU memory, utilisation and processes per host, with the orch run holding each."""
    from . import gpu

    ws = workspace()
    inv = inventory(ws)
    targets = inv.select(None) if all_hosts else [inv.get(h) for h in (host or [LOCAL])]
    clusters = {h.name: _cluster_gpus(h) for h in targets if h.scheduler}  # the scheduler's view, by node
    found = gpu.snapshots([h for h in targets if not h.scheduler], open_store(ws), timeout=timeout)
    if as_json:
        emit_json({**{name: str(s) if isinstance(s, Exception) else gpu.snapshot_to_dict(s)
                      for name, s in found.items()}, **clusters})
    else:
        if found:
            out.print(gpu.render_table(found))
        for name, nodes in clusters.items():
            table = Table(f"{name} node", "gpus", "in use", "state", "partitions", box=None)
            for n in nodes:
                table.add_row(str(n["node"]), str(n["gpus"]), str(n["used"]), str(n["state"]), _cell(n["partitions"]))
            out.print(table)
    if any(isinstance(s, Exception) for s in found.values()):
        raise typer.Exit(1)


def _cluster_gpus(host: Host) -> list[dict[str, Any]]:
    from .remote import connect
    from .slurm import gpus_by_node

    return gpus_by_node(connect(host))


patch_app = typer.Typer(help="Patch sets for the engines' installed source.", no_args_is_help=True)
app.add_typer(patch_app, name="patch")


@patch_app.command("list")
def patch_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """The patch sets orch knows (its own and those of installed packages)."""
    from . import registry

    sets = registry.patch_sets()
    rows: list[dict[str, Any]] = [
        {"name": p.name, "package": p.package, "versions": p.versions, "files": sorted(p.files),
         "requires_flags": list(p.requires_flags), "revert_after": p.revert_after,
         "set_hash": p.set_hash, "description": p.description} for p in sets]
    if as_json:
        emit_json(rows)
        return
    table = Table("name", "package", "versions", "files", "requires", "revert after", box=None)
    for r in rows:
        table.add_row(r["name"], r["package"], r["versions"], str(len(r["files"])), " ".join(r["requires_flags"]),
                      "yes" if r["revert_after"] else "no")
    out.print(table)


def _patch_target(name: str | None, host: str) -> tuple[Any, Any, Store]:
    from . import registry
    from .remote import connect

    ws = workspace()
    target = inventory(ws).get(host)
    ps = registry.patch_set(name) if name else None
    return ps, connect(target), open_store(ws)


def _print_patch_result(res: Any, as_json: bool) -> None:
    if as_json:
        import dataclasses

        emit_json(dataclasses.asdict(res))
        return
    out.print(f"{res.set_name} {res.action} on {res.host}: {res.package} {res.version or ''} at {res.root}")
    for f in res.files:
        out.print(f"  {f.state:9} {f.file}")


@patch_app.command("check")
def patch_check(name: str, host: str = typer.Option(LOCAL, "--host", "-H"),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """Would the set apply on the host? Changes nothing."""
    from . import patching

    ps, transport, _ = _patch_target(name, host)
    _print_patch_result(patching.check(transport, ps), as_json)


@patch_app.command("apply")
def patch_apply(name: str, host: str = typer.Option(LOCAL, "--host", "-H"),
                as_json: bool = typer.Option(False, "--json")) -> None:
    """Apply every file of the set, or none."""
    from . import patching

    ps, transport, store = _patch_target(name, host)
    _print_patch_result(patching.apply(transport, ps, store=store), as_json)


@patch_app.command("revert")
def patch_revert(name: str, host: str = typer.Option(LOCAL, "--host", "-H"),
                 force: bool = typer.Option(False, "--force", help="revert files changed since patching"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Restore the original bytes of every file the set patched."""
    from . import patching, registry

    _, transport, store = _patch_target(None, host)
    known = {p.name: p for p in registry.patch_sets(loadable_only=True)}
    _print_patch_result(patching.revert(transport, known.get(name, name), force=force, store=store), as_json)


@patch_app.command("status")
def patch_status(host: str = typer.Option(LOCAL, "--host", "-H"), as_json: bool = typer.Option(False, "--json")) -> None:
    """Which sets are applied on the host, by which run, and whether the files still match."""
    import dataclasses

    from . import patching, registry

    _, transport, store = _patch_target(None, host)
    applied = patching.status(transport, registry.patch_sets(loadable_only=True), store)
    if as_json:
        emit_json([{**dataclasses.asdict(a), "intact": a.intact} for a in applied])
        return
    if not applied:
        out.print(f"no patch sets applied on {host}")
    for a in applied:
        run = f"run {a.run_id}" if a.run_id else "by hand"
        state = "files match" if a.intact else "FILES CHANGED: " + ", ".join(
            f.file for f in a.files if f.state != "applied")
        out.print(f"{a.set_name} on {a.package} {a.version} ({run}): {state}")


# cron ------------------------------------------------------------------------------------------
cron_app = typer.Typer(help="Nightly sweeps from the user's crontab.", no_args_is_help=True)
app.add_typer(cron_app, name="cron")


@cron_app.command("install")
def cron_install(file: Path = typer.Argument(..., help="sweep file"),
                 at: str = typer.Option(..., "--at", help="cron schedule, e.g. '0 2 * * *'"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Run a sweep on a schedule; a night whose previous sweep still runs is skipped."""
    from . import cron

    entry = cron.install(workspace(), file, at)
    if as_json:
        emit_json(entry.to_dict())
    else:
        out.print(f"cron entry {entry.id}: {entry.schedule} {entry.file} (log {entry.log})", markup=False)


@cron_app.command("list")
def cron_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """orch's entries in the crontab (nothing else there is shown or touched)."""
    from . import cron

    found = cron.entries()
    if as_json:
        emit_json([e.to_dict() for e in found])
        return
    table = Table("id", "schedule", "sweep", "workspace", "enabled", box=None)
    for e in found:
        table.add_row(e.id, e.schedule, e.file or "?", e.workspace or "?", "yes" if e.enabled else "no")
    out.print(table)


@cron_app.command("remove")
def cron_remove(entry_id: str = typer.Argument(..., metavar="ID")) -> None:
    """Remove one of orch's crontab entries."""
    from . import cron

    entry = cron.remove(entry_id)
    err.print(f"removed cron entry {entry.id} ({entry.schedule} {entry.file})", markup=False)


@cron_app.command("fire", hidden=True)
def cron_fire(entry_id: str = typer.Argument(..., metavar="ID"), file: Path = typer.Argument(...),
              instance: str | None = typer.Option(
                  None, "--instance", hidden=True, help="the sweep's instance; default: today's local date")) -> None:
    """What the crontab line runs: the sweep under its lock, or a recorded skip."""
    from . import cron

    raise typer.Exit(cron.fire(workspace(), entry_id, file, instance=instance))


# sweeps ----------------------------------------------------------------------------------------
sweep_app = typer.Typer(help="Grids of runs over hosts: run (or resume), status, cancel.", no_args_is_help=True)
app.add_typer(sweep_app, name="sweep")


@sweep_app.command("run")
def sweep_run(file: Path = typer.Argument(..., help="sweep file (TOML)"),
              detach: bool = typer.Option(False, "--detach", help="run the controller in the background"),
              instance: str = typer.Option(
                  "", "--instance", help="which run of this file (e.g. a date); another instance is a new sweep")) -> None:
    """Run every point of a sweep; the same file (and instance) again resumes it."""
    from . import sweep

    ws = workspace()
    if detach:
        sweep_id, log = sweep.detach(ws, file, instance)
        err.print(f"sweep {sweep_id} runs in the background; log: {log}", markup=False)
        out.print(sweep_id)
        return
    doc = sweep.run(ws, file, echo=lambda line: err.print(line, markup=False), instance=instance)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(doc["counts"].items()))
    err.print(f"sweep {doc['id']} ({doc['name']}) {doc['status']}: {counts}", markup=False)
    raise typer.Exit(0 if doc["status"] == "succeeded" else 1)


@sweep_app.command("status")
def sweep_status(ref: str | None = typer.Argument(None, metavar="[SWEEP]", help="id or name"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Sweeps, newest first, or one sweep point by point."""
    from . import sweep

    store = open_store(workspace())
    if ref is None:
        docs = sweep.list_sweeps(store)
        if as_json:
            emit_json(docs)
            return
        table = Table("id", "name", "instance", "playbook", "status", "points", "age", box=None)
        for d in docs:
            table.add_row(str(d["id"]), d["name"], d["instance"], d["playbook"], d["status"],
                          " ".join(f"{n} {s}" for s, n in sorted(d["counts"].items())), _age(time.time() - d["created_at"]))
        out.print(table)
        return
    doc = sweep.document(store, sweep.resolve(store, ref))
    if as_json:
        emit_json(doc)
        return
    title = f"{doc['name']} {doc['instance']}" if doc["instance"] else doc["name"]
    out.print(f"sweep {doc['id']} {title} ({doc['playbook']}): {doc['status']}", markup=False)
    table = Table("#", "point", "host", "status", "run", "tries", "metrics", "reason", box=None)
    for p in doc["points"]:
        metrics = " ".join(f"{k}={v:g}" for k, v in list(p["metrics"].items())[:3])
        table.add_row(str(p["index"]), sweep.label(p["point"]), p["host"] + (f":{p['gpus']}" if p["gpus"] else ""),
                      p["status"], str(p["run_id"] or ""), str(p["attempts"]), metrics,
                      (p["reason"] or "")[:80] if p["status"] != "succeeded" else "")
    out.print(table)


@sweep_app.command("cancel")
def sweep_cancel(ref: str = typer.Argument(..., metavar="SWEEP", help="id or name"),
                 grace: float = typer.Option(10.0, help="seconds between SIGTERM and SIGKILL")) -> None:
    """Cancel the queued points and stop the running ones."""
    from . import sweep

    res = sweep.cancel(workspace(), ref, grace)
    stopped = ", ".join(f"run {r} ({o})" for r, o in res["stopped"].items()) or "no runs"
    err.print(f"sweep {res['sweep_id']} cancelled: {res['queued_cancelled']} queued point(s), stopped {stopped}",
              markup=False)


@sweep_app.command("report")
def sweep_report(ref: str = typer.Argument(..., metavar="SWEEP", help="id or name"),
                 metric: str | None = typer.Option(None, help="picks the best point (default: the first metric)"),
                 chart: list[str] = typer.Option([], "--chart", help="metric drawn per point (default: all)"),
                 series: list[str] = typer.Option([], "--series", help="metric drawn over time (default: sampled ones)")) -> None:
    """Write runs/sweeps/<id>/report.html: the points, their spec differences and metrics, charts."""
    from . import report, sweep

    ws = workspace()
    store = open_store(ws)
    sweep_id = sweep.resolve(store, ref)
    page = report.sweep_report(store, sweep_id, ws.runs_dir / "sweeps" / str(sweep_id), metric,
                               chart or None, series or None)
    out.print(str(page), markup=False)


# dashboard -------------------------------------------------------------------------------------
@app.command()
def ui(port: int = typer.Option(8765, "--port"),
       bind: str = typer.Option("127.0.0.1", "--bind", help="loopback unless a --token guards it"),
       allow_actions: bool = typer.Option(False, "--allow-actions", help="cancel and stop from the pages"),
       token: str | None = typer.Option(None, "--token", envvar="ORCH_UI_TOKEN",
                                        help="what a browser must show (default: a new one each start)")) -> None:
    """A web dashboard of this workspace: runs, sweeps, hosts, live; read-only unless --allow-actions."""
    from . import ui as dashboard

    dashboard.serve(workspace(), port=port, bind=bind, allow_actions=allow_actions, token=token,
                    echo=lambda line: err.print(line, markup=False))


# entry point -----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """Exit codes in one place: 0 ok, 1 the run failed or an operation failed, 2 bad input.

    Typer's standalone mode already maps usage errors to 2 and typer.Exit to its code; OrchErrors
    become one message without a traceback; anything else is a bug and keeps its traceback.
    """
    command = typer.main.get_command(app)
    try:
        command.main(args=argv, prog_name="orch", standalone_mode=True)
    except OrchError as exc:
        first, *rest = str(exc).splitlines() or [type(exc).__name__]
        err.print(f"orch: {first}", markup=False)
        for line in rest:
            err.print(f"  {line}", markup=False)
        sys.exit(exc.exit_code)
    finally:
        from .remote import close_all

        close_all()
        if "orchestrator.notify" in sys.modules:  # notifications still being sent: a bounded wait
            sys.modules["orchestrator.notify"].drain()


__all__ = ["app", "main"]
