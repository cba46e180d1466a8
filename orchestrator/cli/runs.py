"""Commands on runs: run, rerun, watch, status, note, tag, cancel, stop, rm, gc (logs, pull, ssh: logs.py)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from ..config import metricinfo
from ..config.workspace import LOCAL
from ..errors import OrchError, UsageError
from ..store.record import KILL_GRACE_S, RunRecord, Status
from ..store.shapes import run_document
from .app import age_seconds, app, inventory, open_store, parse_run_id, read_store, workspace
from .catalog import RunCommand
from .render import emit_json, err, out, summary_lines, table

RUN_EXAMPLES = """Examples:

  orch run command --set 'cmd=python train.py' --detach

  orch run extract-hidden-states --host gpu01 --set model=/data/kimi --set 'layers=[2,30,58]'

  orch run serve-eagle3 --host gpu01 -f eagle3.toml --until-ready
"""


# The options `run` and `rerun` share: one definition each. (A list default is Typer's to copy: each call
# gets a list of its own.)
Sets = Annotated[list[str], typer.Option("--set", metavar="KEY=VALUE", help="a spec key (value read as a TOML literal)")]
Detach = Annotated[bool, typer.Option("--detach", help="return right after a good launch")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="list what a start would send to the host; do nothing")]
UntilReady = Annotated[bool, typer.Option("--until-ready", help="return once the job is ready")]
Queue = Annotated[bool, typer.Option("--queue", help="wait while the host (or GPU set) is busy")]
Replace = Annotated[bool, typer.Option("--replace", help="stop the orch runs holding the hosts (or GPU set) first")]
AsJson = Annotated[bool, typer.Option("--json", help="the end-of-run summary (or the launch, the dry run) as JSON")]
Name = Annotated[str | None, typer.Option("--name", metavar="NAME", help="a name for the run, shown by status")]
Tags = Annotated[list[str], typer.Option("--tag", metavar="TAG", help="a tag on the run (repeatable)")]
Note = Annotated[str | None, typer.Option("--note", metavar="TEXT", help="a note on the run")]


@app.command(cls=RunCommand, epilog=RUN_EXAMPLES)
def run(
    playbook: str = typer.Argument(..., metavar="PLAYBOOK", help="see `orch playbooks`"),
    host: list[str] = typer.Option([LOCAL], "--host", "-H", metavar="HOST",
                                   help="once per node for a run across hosts (the first is the head); @TAG: "
                                        "`nodes` hosts with that tag"),
    file: Path | None = typer.Option(None, "--file", "-f", metavar="SPEC.toml", help="spec TOML"),
    sets: Sets = [], detach: Detach = False, dry_run: DryRun = False, until_ready: UntilReady = False,  # noqa: B006
    queue: Queue = False, replace: Replace = False, as_json: AsJson = False, name: Name = None, tags: Tags = [],  # noqa: B006
    note: Note = None,
) -> None:
    """Run a playbook on a host and watch it to the end."""
    from ..config import spec as specmod
    from ..runflow import registry

    pb = registry.playbook(playbook)
    _start(pb, specmod.load(pb.Spec, file, sets), host, detach, dry_run, until_ready, queue, replace, as_json,
           _labels(name, tags, note))


@app.command(epilog="Example:\n\n  orch rerun 7 --set batch_size=8 --host gpu02")
def rerun(
    run_id: str = typer.Argument(..., metavar="ID"),
    host: list[str] = typer.Option([], "--host", "-H", metavar="HOST", help="default: the run's host(s)"),
    sets: Sets = [], detach: Detach = False, dry_run: DryRun = False, until_ready: UntilReady = False,  # noqa: B006
    queue: Queue = False, replace: Replace = False, as_json: AsJson = False, name: Name = None, tags: Tags = [],  # noqa: B006
    note: Note = None,
) -> None:
    """Run a run's playbook again with its spec, changed by --set."""
    from ..config import spec as specmod
    from ..runflow import registry

    store = read_store(workspace())
    old = store.get_run(parse_run_id(run_id))
    pb = registry.playbook(old.playbook)
    spec = specmod.build(pb.Spec, specmod.merge_sets(old.spec, sets, pb.Spec), source=f"spec of run {old.id}")
    hosts = host or [n.host for n in store.nodes_of(old.id)] or [old.host]
    _start(pb, spec, hosts, detach, dry_run, until_ready, queue, replace, as_json, _labels(name, tags, note))


def _labels(name: str | None, tags: list[str], note: str | None) -> dict[str, Any]:
    """The run's own columns for a name, tags and a note (what was given)."""
    fields: dict[str, Any] = {"name": name, "tags": list(dict.fromkeys(tags)) or None, "note": note}
    return {k: v for k, v in fields.items() if v is not None}


def _dry_run(ws: Any, pb: Any, spec: Any, targets: list[Any], as_json: bool) -> None:
    """What a start would send, printed (each secret masked, as the record would)."""
    from .. import runflow

    store = read_store(ws)  # a dry run creates no database either
    try:
        done = runflow.dry_run(ws, store, pb, spec, targets)
    finally:
        store.close()
    if as_json:
        emit_json(done.document())
    else:
        out.print(done.text(), end="")


def _start(pb: Any, spec: Any, host: list[str], detach: bool, dry_run: bool, until_ready: bool, queue: bool,
           replace: bool, as_json: bool, labels: dict[str, Any]) -> None:
    from .. import runflow
    from ..host import hostlease
    from ..store import lease

    ws = workspace()
    if len(host) > 1 and spec.nodes == 1:
        spec = spec.model_copy(update={"nodes": len(host)})
    targets = inventory(ws).for_run(host, spec.nodes)
    target = targets[0]
    if dry_run:
        _dry_run(ws, pb, spec, targets, as_json)
        return
    store = open_store(ws)
    waited: list[str] = []

    def on_wait(busy: runflow.Waiting) -> None:
        if not waited:
            line = runflow.busy_message(store, busy, ways_on=False)
            waited.append(line)  # before the line: a Ctrl-C right after it finds the wait recorded
            err.print(f"waiting: {line}")

    newest = store.newest_run_id()
    try:
        if len(targets) > 1:
            run = runflow.start_nodes(ws, store, pb, spec, targets, queue=queue, on_wait=on_wait, replace=replace,
                                      run_fields=labels)
        else:
            run = runflow.start(ws, store, pb, spec, target, queue=queue, on_wait=on_wait, replace=replace,
                                run_fields=labels)
    except (lease.Busy, hostlease.HostLeaseBusy) as busy:
        raise OrchError(runflow.busy_message(store, busy)) from None
    except KeyboardInterrupt:
        if waited and not _started_here(store, newest):  # Ctrl-C in the queue: nothing to leave running
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            err.print(f"orch: stopped waiting; no run was started ({waited[0]})", markup=False)
            raise typer.Exit(130) from None
        raise
    job = run.record.job or "no job"
    err.print(f"run {run.run_id}: {pb.name} on {target.name}, {job} in {run.paths.root}")
    for node in store.nodes_of(run.run_id)[1:]:
        err.print(f"  node {node.node_rank}: {node.host}, {node.job or 'no job'} in {node.remote_dir}")
    if detach:
        _hand_over(run)
        if as_json:
            started = run.refresh()
            emit_json(run_document(store, started, with_events=False, headlines=metricinfo.headlines(started.playbook)))
        else:
            out.print(run.run_id)
        return
    _follow(run, until_ready, as_json)


def _started_here(store: Any, newest: int) -> bool:
    """Whether this process created a run (one newer than `newest`, whose starter it is)."""
    from ..store.controller import Controller

    me = str(Controller.me())
    return store.count_runs(after_id=newest, watcher=me) > 0


def _hand_over(run: Any) -> None:
    """This process stops watching the run; a background watcher keeps it (see runflow/watching.py)."""
    from ..runflow import watching

    run.release()
    watching.ensure_watched(run.ws, run.store, [run.record])


@app.command()
def watch(run_id: str = typer.Argument(..., metavar="ID"), until_ready: bool = typer.Option(False, "--until-ready"),
          as_json: bool = typer.Option(False, "--json", help="the end-of-run summary as JSON"),
          background: bool = typer.Option(False, "--background", hidden=True,
                                          help="watch to the end without output (what orch starts for a run)")) -> None:
    """Resume watching a run (after a detach, Ctrl-C or a dead controller)."""
    from .. import runflow

    ws = workspace()
    run = runflow.open_run(ws, open_store(ws), parse_run_id(run_id), inventory(ws), any_spec=background)
    if background:  # its host's watcher follows it, with the host's other runs
        from ..watch import hostwatch

        hostwatch.serve(ws, run.host.name)
        return
    _follow(run, until_ready, as_json)


@app.command("watch-host", hidden=True)
def watch_host(name: str = typer.Argument(..., metavar="HOST"),
               background: bool = typer.Option(False, "--background", hidden=True)) -> None:
    """Follow every active run of a host until none is left (what orch starts for a host)."""
    from ..watch import hostwatch

    ws = workspace()
    inventory(ws).get(name)  # an unknown host: one line, exit 2
    hostwatch.serve(ws, name)


def _follow(run: Any, until_ready: bool, as_json: bool) -> None:
    """Watch through the run flow, showing its events and a live progress line; Ctrl-C detaches."""
    from rich.live import Live

    from ..runflow import outcome
    from ..watch import follow
    from .liveview import PlainProgress, RunView

    tty = err.is_terminal
    view = RunView(run.record)
    # a person at a terminal: the line is drawn anew every second; elsewhere, a plain line now and then
    live = Live(view, console=err, transient=True, refresh_per_second=1, auto_refresh=tty)
    plain = None if tty else PlainProgress(err.print)
    seen = len(run.store.events(run.run_id))

    def show(record: RunRecord) -> None:
        nonlocal seen
        events = run.store.events(run.run_id)
        for e in events[seen:]:
            if e["kind"] != "status" or e["message"].split(":")[0] in ("running",):
                live.console.print(f"{time.strftime('%H:%M:%S', time.localtime(e['ts']))} {e['kind']}: {e['message']}")
        seen = len(events)
        view.update(record)
        if plain is not None:
            plain.update(record)

    before = signal.signal(signal.SIGINT, _interrupted)
    try:
        with live:
            final = follow.watch(run, until_ready=until_ready, on_update=show)
    except KeyboardInterrupt:
        _detach(run)
    finally:
        if signal.getsignal(signal.SIGINT) is _interrupted:
            signal.signal(signal.SIGINT, before)
    doc = outcome.summary(run.ws, run.store, final, run.host)
    if as_json:
        emit_json(doc)
    for line in summary_lines(doc):
        err.print(line)
    raise typer.Exit(0 if final.status is Status.SUCCEEDED or final.status.live else 1)


def _ignore(signum: int, frame: Any) -> None:
    """A Ctrl-C after the first: the detach under way ends the command anyway."""


def _interrupted(signum: int, frame: Any) -> None:
    """The first Ctrl-C while following a run: stop following; any later one is ignored (so it never ends
    in a traceback). Not SIG_IGN: a watcher started from here gets the default handler back."""
    signal.signal(signal.SIGINT, _ignore)
    raise KeyboardInterrupt


def _detach(run: Any) -> NoReturn:
    """Ctrl-C while following a run: leave it to its watcher at once, one line on stderr, exit 0 (the
    hand-over is a record write and at most a process start)."""
    signal.signal(signal.SIGINT, _ignore)
    who = "its host's watcher follows it"
    run.event("detached", f"Ctrl-C: this process stopped following the run; {who}")
    _hand_over(run)
    err.print(f"orch: detached; run {run.run_id} goes on ({who}): "
              f"orch watch {run.run_id} · orch logs {run.run_id} -f", markup=False)
    # the interpreter's exit puts the default back in place of a Python handler, and one more Ctrl-C then
    # would end it by SIGINT, not exit 0; SIG_IGN stays (set after the hand-over: a watcher started there
    # must not inherit it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise typer.Exit(0)


@app.command(epilog="Example:\n\n  orch note 7 'baseline for the fp8 sweep'")
def note(run_id: str = typer.Argument(..., metavar="ID"), text: str = typer.Argument(..., metavar="TEXT"),
         as_json: bool = typer.Option(False, "--json", help="the run as `status ID --json` shows it")) -> None:
    """Add a note to a run (kept one a line, under the ones it has)."""
    _label(run_id, as_json, note=text)


@app.command(epilog="Example:\n\n  orch tag 7 baseline fp8")
def tag(run_id: str = typer.Argument(..., metavar="ID"), tags: list[str] = typer.Argument(..., metavar="TAG..."),
        as_json: bool = typer.Option(False, "--json", help="the run as `status ID --json` shows it")) -> None:
    """Add tags to a run (`orch status --tag TAG` lists the runs with one)."""
    _label(run_id, as_json, tags=tags)


def _label(run_id: str, as_json: bool, **labels: Any) -> None:
    store = read_store(workspace())  # no database: no run to label, and none created
    run = store.label_run(parse_run_id(run_id), **labels)
    if as_json:
        emit_json(run_document(store, run, with_events=False, headlines=metricinfo.headlines(run.playbook)))
    else:
        notes = len((run.note or "").splitlines())
        err.print(f"run {run.id}: tags {', '.join(run.tags) or '-'}; {notes} note line(s)")


@app.command()
def cancel(run_id: str = typer.Argument(..., metavar="ID"),
           grace: float = typer.Option(KILL_GRACE_S, metavar="SECONDS", help="seconds between SIGTERM and SIGKILL"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Kill a run's process group; its status becomes cancelled."""
    from .. import runflow

    ws = workspace()
    store, inv, number = open_store(ws), inventory(ws), parse_run_id(run_id)
    record = store.get_run(number)
    _not_a_node(record, "cancel")
    host = record.host
    if host not in inv.hosts:  # a way out: the record ends, whatever still runs there is the user's to stop
        runflow.abandon(store, number, f"cancelled by user; host {host} is no longer in the inventory, so its job "
                                   "(if any) was not stopped")
        err.print(f"run {number} cancelled; host {host} is no longer in the inventory: its job, if any, still runs")
        return
    run = runflow.open_run(ws, store, number, inv, any_spec=True)
    outcome = runflow.cancel(run, "cancelled by user", grace)
    status = run.refresh().status
    if as_json:
        emit_json({"id": run.run_id, "status": status.value, "process_group": outcome})
    err.print(f"run {run.run_id} cancelling: {outcome}" if status is Status.CANCELLING
              else f"run {run.run_id} cancelled ({outcome})")


def _not_a_node(record: RunRecord, verb: str) -> None:
    """One node alone is never ended: its run's other nodes would wait on it. Ending the run ends them all."""
    if record.parent_id is not None:
        raise UsageError(f"run {record.id} is node {record.node_rank} of run {record.parent_id}: {verb} the run"
                         f" (`orch {verb} {record.parent_id}`)")


@app.command("stop")
def stop_cmd(run_id: str = typer.Argument(..., metavar="ID"),
             grace: float = typer.Option(KILL_GRACE_S, metavar="SECONDS", help="seconds between SIGTERM and SIGKILL"),
             as_json: bool = typer.Option(False, "--json")) -> None:
    """End a run (a server): stop its process group, mark it cancelled, wait until its GPUs are free."""
    from .. import runflow

    ws = workspace()
    store = open_store(ws)
    _not_a_node(store.get_run(parse_run_id(run_id)), "stop")
    run = runflow.open_run(ws, store, parse_run_id(run_id), inventory(ws))
    outcome = runflow.stop(run, grace)
    status = run.refresh().status
    if as_json:
        emit_json({"id": run.run_id, "status": status.value, "outcome": outcome})
    err.print(f"run {run.run_id} cancelling: {outcome}" if status is Status.CANCELLING
              else f"run {run.run_id} stopped: {outcome}")


@app.command("rm", epilog="Example:\n\n  orch rm 3 4 5")
def rm(run_ids: list[str] = typer.Argument(..., metavar="ID..."),
       keep_remote: bool = typer.Option(False, "--keep-remote", help="leave the run dirs on the hosts"),
       as_json: bool = typer.Option(False, "--json")) -> None:
    """Remove ended runs: their records, local artifacts and remote run dirs (never an active run)."""
    ws = workspace()
    store = open_store(ws)
    _remove(ws, store, [store.get_run(parse_run_id(r)) for r in run_ids], keep_remote, as_json)


@app.command("gc", epilog="Example:\n\n  orch gc --older-than 30d --dry-run")
def gc(older_than: str = typer.Option(..., "--older-than", metavar="AGE", help="e.g. 30d, 12h, 90m"),
       keep_remote: bool = typer.Option(False, "--keep-remote", help="leave the run dirs on the hosts"),
       dry_run: bool = typer.Option(False, "--dry-run", help="list what would be removed"),
       as_json: bool = typer.Option(False, "--json")) -> None:
    """Remove ended runs older than AGE (runs of a sweep stay with their sweep)."""
    from ..host import retention

    ws = workspace()
    store = open_store(ws)
    found = retention.older_than(store, age_seconds(older_than))
    if dry_run:
        if as_json:
            emit_json([{"id": r.id, "status": r.status.value, "remote_dir": r.remote_dir} for r in found])
        else:
            table(["id", "playbook", "host", "status", "remote dir"],
                  [[r.id, r.playbook, r.host, r.status.value, r.remote_dir] for r in found])
        return
    _remove(ws, store, found, keep_remote, as_json)


def _remove(ws: Any, store: Any, runs: list[Any], keep_remote: bool, as_json: bool) -> None:
    from ..host import retention

    done = retention.remove(ws, store, runs, inventory(ws), keep_remote=keep_remote)
    if as_json:
        emit_json([{"id": d.run_id, "removed": d.ok, "remote": d.remote} for d in done])
    else:
        for d in done:
            err.print(f"run {d.run_id} {'removed' if d.ok else 'kept'}: {d.remote}")
    if not all(d.ok for d in done):
        raise typer.Exit(1)
