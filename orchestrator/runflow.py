"""The run flow: from a spec to a finished run, and every way a run ends.

start: check → create the run with its lease → patch sets checked → GPU cleanup → patches applied →
prepare → launch. watch/poll: the watcher records what the log says until the run ends. Every ending
(the watcher's verdict, cancel, stop, another run's GPU cleanup, a dead controller's run settled, a
failed start) reaches `finish`, which runs the end steps — outputs, log tail, patch revert,
notification — each exactly once whoever ends the run, then frees its lease.

Modules below this one never call up into it: the lease and GPU cleanup get callbacks.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from . import cleanup, gpu, lease, notify, patching, registry
from .errors import HostError, OrchError, SpecError, TransitionError, Unreachable, UsageError
from .executor import Executor, executor_for
from .hosts import Host, Inventory
from .launch import RunPaths, job_script, launch_command
from .lifecycle import transition
from .playbook import JobContext, Playbook, Prepared
from .record import ACTIVE, Run, Status
from .remote import Result, Transport, connect, quote
from .spec import RunSpec
from .store import Store
from .watch import Watcher, WatchOptions
from .workspace import Workspace

KILL_GRACE_S = 10.0
LOG_TAIL_LINES = 200
END_STEPS = ("outputs", "log tail", "patch revert", "notify")


@dataclass
class Context:
    """One run as the flow acts on it: its record's id, playbook, spec, host and where its job lives."""

    ws: Workspace
    store: Store
    pb: Playbook[Any]
    host: Host
    transport: Transport
    executor: Executor
    run_id: int
    spec: RunSpec
    paths: RunPaths

    @property
    def run(self) -> Run:
        return self.store.get_run(self.run_id)

    def event(self, kind: str, message: str, data: Any = None) -> None:
        self.store.add_event(self.run_id, kind, message, data)

    def job(self, dry_run: bool = False) -> JobContext[Any]:
        """The playbook's view of the run."""
        return JobContext(self.run_id, self.spec, self.host, self.paths, self.transport, self.store.get_run,
                          lambda kind, message: self.event(kind, message), dry_run)


Hosts = Inventory | Mapping[str, Host]


def _host(ws: Workspace, name: str, hosts: Hosts | None) -> Host:
    if isinstance(hosts, Inventory):
        return hosts.get(name)
    if hosts is not None and name in hosts:
        return hosts[name]
    return Inventory.load(ws.hosts_file, ws.root).get(name)


def _spec(pb: Playbook[Any], run: Run) -> RunSpec:
    try:
        return pb.Spec.model_validate(run.spec)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors())
        raise SpecError(f"run {run.id}: its stored spec no longer validates: {problems}") from None


def open_run(ws: Workspace, store: Store, run: Run | int, hosts: Hosts | None = None) -> Context:
    """The one way to act on an existing run: its playbook, spec, host and paths from its record."""
    record = store.get_run(run) if isinstance(run, int) else run
    pb = registry.playbook(record.playbook)
    host = _host(ws, record.host, hosts)
    transport = connect(host)
    root = record.remote_dir or RunPaths.for_run(transport.expand(host.workdir), record.id).root
    return Context(ws, store, pb, host, transport, executor_for(host, transport), record.id, _spec(pb, record),
                   RunPaths(root))


def watch_options(pb: Playbook[Any], spec: RunSpec, host: Host, until_ready: bool = False) -> WatchOptions:
    lo, hi = host.default_poll
    lo = spec.poll_min or lo
    hi = max(spec.poll_max or hi, lo)
    return WatchOptions(
        poll_min=lo,
        poll_max=hi,
        until_ready=until_ready,
        ready_pattern=pb.ready_pattern(spec),
        engine=pb.log_engine(spec),
        stall_factor=spec.stall_factor,
        on_stall=spec.on_stall,
        health=pb.health(spec, host),
    )


# starting ----------------------------------------------------------------------------------------
def check(store: Store, pb: Playbook[Any], spec: RunSpec, host: Host) -> None:
    """Refuse, before anything is touched, input only the registry, the store or the inventory can judge."""
    for name in spec.patches:
        ps = registry.patch_set(name)
        if not ps.requires_flags:
            continue
        argv = pb.engine_argv(spec)
        missing = patching.missing_flags(ps, argv) if argv is not None else list(ps.requires_flags)
        if missing:
            raise UsageError(f"patch set {name} needs {' '.join(missing)} in the launch command "
                             f"(debug code does not run under CUDA graph replay)")
    pb.check_inputs(spec, host, store.get_run)


def run_token(ws: Workspace, store: Store, run_id: int) -> str:
    """Names this run of this workspace in its remote dir, so another workspace's run N is not taken for it."""
    created = store.conn.execute("SELECT created_at FROM runs WHERE id = ?", (run_id,)).fetchone()
    return f"{socket.gethostname()}:{ws.db_path}:{run_id}:{created[0] if created else 0}"


def start(ws: Workspace, store: Store, pb: Playbook[Any], spec: RunSpec, host: Host, *, queue: bool = False,
          on_wait: Callable[[lease.Busy], None] | None = None,
          run_fields: dict[str, Any] | None = None) -> Context:
    """Create the run and take it to `running`; on any failure the run ends `failed` with the reason.

    The run is created together with its lease on the host (or its GPU set): a busy host raises
    lease.Busy naming the holder, or with queue waits for it.
    """
    check(store, pb, spec, host)

    def create() -> int:
        new_id = store.create_run(pb.name, host.name, spec.model_dump(mode="json"))
        store.update_run(new_id, **(run_fields or {}))
        return new_id

    if pb.exclusive:
        opts = watch_options(pb, spec, host)
        run_id = lease.take(store, host.name, spec.gpus, create, (opts.poll_min, opts.poll_max), queue=queue,
                            on_wait=on_wait, probe=lambda orphan: probe_orphan(ws, store, orphan))
    else:
        with store.tx():
            run_id = create()
    (ws.run_dir(run_id) / "spec.json").write_text(
        json.dumps({"playbook": pb.name, "host": host.name, "spec": spec.model_dump(mode="json")}, indent=2)
    )
    transition(store, run_id, Status.PREPARING)
    ctx: Context | None = None
    try:
        transport = connect(host)
        paths = RunPaths.for_run(transport.expand(host.workdir), run_id)
        store.update_run(run_id, remote_dir=paths.root)
        ctx = Context(ws, store, pb, host, transport, executor_for(host, transport), run_id, spec, paths)
        script = _steps_before_launch(ctx)
        transition(store, run_id, Status.LAUNCHING)
        pid, pid_start = ctx.executor.launch(paths, script, run_token(ws, store, run_id))
    # A run that never launched has no job, so no phase: it does not pretend to be `starting`.
    except OrchError as exc:
        end(store, run_id, Status.FAILED, f"before launch: {exc}", ctx, phase=None)
        raise
    except Exception as exc:  # a bug: the run must not stay `preparing`, and the bug must still show
        end(store, run_id, Status.FAILED, f"before launch: internal error: {type(exc).__name__}: {exc}", ctx,
            phase=None)
        raise
    transition(store, run_id, Status.RUNNING, f"pid {pid} on {host.name}", pid=pid, pid_start=pid_start)
    return ctx


def _steps_before_launch(ctx: Context) -> str:
    # Patch sets are checked (read-only) first, so a set that does not apply changes nothing anywhere.
    sets = [registry.patch_set(name) for name in ctx.spec.patches]
    for ps in sets:
        patching.check(ctx.transport, ps)
    gpu_env = free_gpus(ctx) if ctx.spec.cleanup else {}
    applied: list[str] = []
    for ps in sets:
        res = patching.apply(ctx.transport, ps, run_id=ctx.run_id, store=ctx.store)
        applied.append(ps.name)
        ctx.store.update_run(ctx.run_id, patches_applied=applied)
        ctx.event("patch", f"{ps.name} on {res.package} {res.version}: " + _file_states(res),
                  {"applied": ps.name, "set_hash": ps.set_hash, "files": [f.__dict__ for f in res.files]})
    job = ctx.job()
    return _job_script(ctx, job, ctx.pb.prepare(job), gpu_env)


def free_gpus(ctx: Context, *, grace_s: float = KILL_GRACE_S, timeout_s: float = gpu.CLEANUP_TIMEOUT_S,
              sleep: Callable[[float], None] = time.sleep) -> dict[str, str]:
    """The GPU cleanup step: earlier runs on the GPUs are cancelled (and finished) first; the job's
    CUDA_VISIBLE_DEVICES."""
    return cleanup.before_launch(ctx.transport, ctx.store, ctx.run_id, ctx.spec.gpus, ctx.spec.kill_foreign,
                                 ctx.event, lambda other, reason: _stop_other(ctx, other, reason, grace_s),
                                 grace_s=grace_s, timeout_s=timeout_s, sleep=sleep)


def _job_script(ctx: Context, job: JobContext[Any], prepared: Prepared, gpu_env: dict[str, str]) -> str:
    """The job's environment (host, spec, GPUs, then what prepare added), working dir and command lines."""
    env = {**ctx.host.env, **ctx.spec.env, **gpu_env, **prepared.env}
    return job_script(ctx.pb.command(job, prepared), env, ctx.pb.cwd(ctx.spec))


def _file_states(res: Any) -> str:
    return ", ".join(f"{f.file} {f.state}" for f in res.files)


class DryRunTransport(Transport):
    """Prints each remote command instead of running it."""

    def __init__(self, host: Host, echo: Callable[[str], None]):
        self.host, self.echo = host, echo
        self._home = "$HOME" if not host.is_local else connect(host).home()

    def run(self, command: str, *, check: bool = True, timeout: float | None = None) -> Result:
        self.echo(f"# on {self.host.name}:\n{command.rstrip()}\n")
        return Result(self.host.name, command, 0, "", "")

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None:
        self.echo(f"# upload {len(data)} bytes to {self.host.name}:{path}\n")


def dry_run(ws: Workspace, store: Store, pb: Playbook[Any], spec: RunSpec, host: Host,
            echo: Callable[[str], None]) -> None:
    """Print every step a run would take, and its remote commands, touching nothing."""
    check(store, pb, spec, host)
    transport = DryRunTransport(host, echo)
    next_id = store.conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM runs").fetchone()[0]
    paths = RunPaths.for_run(transport.expand(host.workdir), next_id)
    ctx = Context(ws, store, pb, host, transport, executor_for(host, transport), next_id, spec, paths)
    for name in spec.patches:
        ps = registry.patch_set(name)
        echo(f"# patch set {name}: check, then apply {len(ps.files)} file(s) of {ps.package} {ps.versions}"
             + (" (reverted when the run ends)" if ps.revert_after else "") + "\n")
    gpu_env: dict[str, str] = {}
    if spec.cleanup:
        which = ",".join(map(str, spec.gpus)) if spec.gpus is not None else "every GPU of the host"
        echo(f"# GPU cleanup of {which}: stop stale orch runs there"
             + (", kill foreign processes" if spec.kill_foreign else ", refuse foreign processes")
             + ", wait until free\n")
        if spec.gpus is not None:
            gpu_env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.gpus))}
    job = ctx.job(dry_run=True)
    script = _job_script(ctx, job, pb.prepare(job), gpu_env)
    echo(f"# job.sh for run {next_id}:\n{script}")
    transport.run(launch_command(paths, script, run_token(ws, store, next_id)))


# watching ----------------------------------------------------------------------------------------
def watcher(ctx: Context, *, until_ready: bool = False, on_update: Callable[[Watcher], None] | None = None,
            sleep: Callable[[float], None] = time.sleep) -> Watcher:
    opts = watch_options(ctx.pb, ctx.spec, ctx.host, until_ready)
    return Watcher(ctx.store, ctx.run_id, ctx.executor, opts, on_update=on_update, sleep=sleep)


def watch(ctx: Context, *, until_ready: bool = False, on_update: Callable[[Watcher], None] | None = None,
          sleep: Callable[[float], None] = time.sleep) -> Run:
    """Watch the run until it ends (or, with until_ready, is ready); an ended run is finished."""
    run = ctx.run
    if not run.status.terminal:
        if not run.launched:
            raise OrchError(f"run {run.id} never launched ({run.status})")
        run = watcher(ctx, until_ready=until_ready, on_update=on_update, sleep=sleep).run_until_done()
    return finish(ctx) if run.status.terminal else run


def poll(ctx: Context) -> Run:
    """Poll the run's host once; an ended run is finished."""
    w = watcher(ctx)
    w.poll_once()
    return finish(ctx) if w.run.status.terminal else w.run


# ending ------------------------------------------------------------------------------------------
def end(store: Store, run_id: int, status: Status, message: str, ctx: Context | None = None,
        **fields: Any) -> Run:
    """End a run the watcher did not end itself, then finish it (a run never opened only frees its lease)."""
    transition(store, run_id, status, message, **fields)
    if ctx is None:
        lease.release(store, run_id)
        return store.get_run(run_id)
    return finish(ctx)


def finish(ctx: Context) -> Run:
    """The end steps of an ended run, each at most once whoever calls, then its lease is freed.

    A step is claimed in the record before it runs, so two processes finishing the same run never both
    run it. A step that fails is a warning event; the others still run.
    """
    if not ctx.run.status.terminal:
        return ctx.run
    steps: dict[str, Callable[[Context], None]] = {
        "outputs": _collect_outputs, "log tail": _fetch_log_tail, "patch revert": _revert_patches,
        "notify": _notify,
    }
    try:
        for name in END_STEPS:
            if not _claim_step(ctx.store, ctx.run_id, name):
                continue
            try:
                steps[name](ctx)
                ctx.event("finished", name)  # for the timeline; the record's end_steps is what counts
            except Exception as exc:  # noqa: BLE001 - one step's failure must not skip the others
                what = str(exc) if isinstance(exc, OrchError) else f"{type(exc).__name__}: {exc}"
                ctx.event("warning", f"{name}: {what}")
    finally:
        lease.release(ctx.store, ctx.run_id)  # the host (or GPU set) is free for the next run
    return ctx.run


def _claim_step(store: Store, run_id: int, name: str) -> bool:
    """Record that the step runs now; False when it already ran (or runs elsewhere)."""
    with store.tx() as c:
        row = c.execute("SELECT end_steps FROM runs WHERE id = ?", (run_id,)).fetchone()
        done = json.loads(row[0]) if row[0] else []
        if name in done:
            return False
        store.update_run(run_id, end_steps=[*done, name])
    return True


def _collect_outputs(ctx: Context) -> None:
    run = ctx.run
    outputs = ctx.pb.finish(ctx.job(), run)
    if outputs.manifest is not None:
        (ctx.ws.run_dir(ctx.run_id) / "outputs.json").write_text(json.dumps(outputs.manifest, indent=2))
    if outputs.metrics:
        ctx.store.add_metrics(ctx.run_id, [(n, v, None) for n, v in outputs.metrics], run.ended_at or 0)


def _fetch_log_tail(ctx: Context) -> None:
    run = ctx.run
    if not run.launched and run.status is not Status.LOST:
        return  # never launched: there is no log (and a host that failed the start is not asked again)
    (ctx.ws.run_dir(ctx.run_id) / "log.tail").write_text(ctx.executor.tail(ctx.paths, LOG_TAIL_LINES))


def _revert_patches(ctx: Context) -> None:
    for name in ctx.run.patches_applied:
        ps = registry.patch_set(name)
        if ps.revert_after:
            res = patching.revert(ctx.transport, ps, run_id=ctx.run_id, store=ctx.store)
            ctx.event("patch", f"{name} reverted: " + _file_states(res))


def notification(store: Store, run: Run) -> dict[str, Any]:
    """What a run's notification says: who, where, how it ended, and its latest metrics."""
    return {
        "event": "run.ended", "run_id": run.id, "playbook": run.playbook, "host": run.host,
        "status": run.status.value, "error_kind": (run.error or {}).get("kind"), "reason": run.reason,
        "metrics": store.latest_metrics(run.id), "started_at": run.started_at, "ended_at": run.ended_at,
    }


def _notify(ctx: Context) -> None:
    if not ctx.spec.notify:
        return
    db_path, run_id = ctx.store.path, ctx.run_id

    def record(url: str, message: str) -> None:
        own = Store(db_path)  # from the sender's thread: a connection of its own, never the run's
        try:
            own.add_event(run_id, "warning", f"notify {url}: {message}")
        finally:
            own.close()

    # a daemon thread: never waits for the receiver
    notify.send(ctx.spec.notify, notification(ctx.store, ctx.run), record, total_s=ctx.spec.notify_timeout_s)


def cancel(ctx: Context, reason: str, grace_s: float = KILL_GRACE_S) -> str:
    """Decide (the run is cancelled), stop its process group, finish it. Returns what happened to the group.

    The decision is recorded first, so a watcher that sees the processes vanish finds it already made
    instead of calling the run lost.
    """
    run = ctx.run
    if run.status.terminal:
        raise OrchError(f"run {run.id} already ended ({run.status})")
    transition(ctx.store, ctx.run_id, Status.CANCELLED, reason)
    try:
        if run.pid is None:
            return "never started"
        outcome = ctx.executor.kill((run.pid, run.pid_start or ""), grace_s)
        ctx.event("stopped", f"process group: {outcome}")
        return outcome
    finally:
        finish(ctx)


def stop(ctx: Context, grace_s: float = KILL_GRACE_S, sleep: Callable[[float], None] = time.sleep,
         timeout_s: float = gpu.CLEANUP_TIMEOUT_S) -> str:
    """End a run (a server, usually) and leave its GPUs free: cancel it, then wait until its GPUs are free.

    The run is cancelled even when its GPUs then stay busy (that raises, naming what holds them).
    """
    outcome = cancel(ctx, "stopped by user", grace_s)
    freed = cleanup.after_stop(ctx.transport, ctx.run, ctx.spec.gpus, ctx.event, grace_s=grace_s, timeout_s=timeout_s,
                               sleep=sleep)
    return f"process group {outcome}; {freed}"


def stop_quietly(ws: Workspace, store: Store, run_id: int, reason: str, hosts: Hosts | None = None,
                 grace_s: float = KILL_GRACE_S) -> str:
    """Cancel a run for a caller that goes on whatever happens (a sweep); what happened, in words."""
    try:
        return cancel(open_run(ws, store, run_id, hosts), reason, grace_s)
    except OrchError as exc:  # it ended meanwhile, or its host cannot be reached
        return str(exc)


def _stop_other(ctx: Context, run_id: int, reason: str, grace_s: float) -> str:
    """GPU cleanup found an earlier run of this workspace on the GPUs: it ends like any run."""
    other = open_run(ctx.ws, ctx.store, run_id, {ctx.host.name: ctx.host})
    run = other.run
    if not run.status.terminal:
        try:
            return cancel(other, reason, grace_s)
        except TransitionError:
            run = other.run  # it ended on its own meanwhile
    if run.pid is None:
        return "gone"
    return other.executor.kill((run.pid, run.pid_start or ""), grace_s)  # ended, but still on the GPUs


# runs whose controller died ------------------------------------------------------------------------
def settle_orphan(ctx: Context) -> Run:
    """A run whose controller died: end it when it never launched, pick up its pid when the launch got
    that far; a running one is left as it is. Returns the run as it is now."""
    run = ctx.run
    if run.status.terminal or run.status is Status.RUNNING:
        return run
    if run.status is Status.LAUNCHING and run.remote_dir:
        # the wrapper may have started: its pid file says so
        fields = ctx.transport.run(f"cat {quote(ctx.paths.pid)} 2>/dev/null || true", timeout=60).stdout.split()
        if len(fields) == 2 and fields[0].isdigit():
            transition(ctx.store, ctx.run_id, Status.RUNNING, "picked up after its controller died",
                       pid=int(fields[0]), pid_start=fields[1])
            return ctx.run
        return end(ctx.store, ctx.run_id, Status.LOST, "its controller died while launching; no job pid was written",
                   ctx)
    return end(ctx.store, ctx.run_id, Status.FAILED, f"its controller died before launch ({run.status})", ctx,
               phase=None)


def probe_orphan(ws: Workspace, store: Store, run: Run) -> None:
    """The lease's probe: settle a run whose controller died and poll it once; if its job has ended, end
    it (which frees its lease)."""
    try:
        ctx = open_run(ws, store, run)
        if settle_orphan(ctx).status is Status.RUNNING:
            poll(ctx)
    except OrchError as exc:  # the host cannot say: the lease stays, the caller reports the holder
        store.add_event(run.id, "warning", f"lease check: {exc}")


def refresh(ws: Workspace, store: Store, ids: list[int] | None, timeout: float,
            on_error: Callable[[str], None]) -> None:
    """Poll every active run's host once; hosts in parallel, each with its own store connection and
    `timeout` seconds: a host that does not answer is reported and left behind."""
    from .fleet import fan_out

    runs = [store.get_run(i) for i in ids] if ids else store.list_runs(limit=10_000, statuses=[s.value for s in ACTIVE])
    runs = [r for r in runs if r.launched and not r.status.terminal]
    inv = Inventory.load(ws.hosts_file, ws.root)
    by_host: dict[str, list[Run]] = {}
    for r in runs:
        by_host.setdefault(r.host, []).append(r)

    def poll_host(name: str) -> None:
        own = Store(ws.db_path)
        try:
            for r in by_host[name]:
                try:
                    poll(open_run(ws, own, r.id, inv))
                except OrchError as exc:
                    on_error(f"run {r.id} on {name}: {exc}")
        finally:
            own.close()

    for name, res in fan_out({n: n for n in by_host}, poll_host, timeout).items():
        if isinstance(res, OrchError):
            on_error(f"{name}: {res}; runs {', '.join(str(r.id) for r in by_host[name])} not refreshed")


# the log ---------------------------------------------------------------------------------------------
def log_tail(ctx: Context, lines: int) -> str:
    return ctx.executor.tail(ctx.paths, lines)


@dataclass
class LogText:
    text: str
    fallback: str | None = None  # why the text is the local copy, not the host's log


def read_log(ws: Workspace, store: Store, run_id: int, lines: int, hosts: Hosts | None = None) -> LogText:
    """The last lines of a run's log from its host or, when the host cannot be reached (or is no longer in
    the inventory), from the tail fetched when the run ended."""
    run = store.get_run(run_id)
    if not run.remote_dir:
        raise OrchError(f"run {run.id} has no log: it never reached its host ({run.status}"
                        + (f": {run.reason})" if run.reason else ")"))
    local = ws.runs_dir / str(run.id) / "log.tail"
    try:
        return LogText(log_tail(open_run(ws, store, run, hosts), lines))
    except (Unreachable, HostError) as exc:
        if not local.is_file():
            raise
        kept = local.read_text(errors="replace").splitlines(keepends=True)[-lines:] if lines > 0 else []
        return LogText("".join(kept), f"{exc}; showing the tail kept when the run ended ({local})")


def follow_log(ctx: Context, write: Callable[[bytes], None], sleep: Callable[[float], None] = time.sleep) -> None:
    """Write the log's new bytes as they come (every second: someone reads along), until the job ended."""
    run = ctx.run
    if run.pid is None:
        return
    size = ctx.transport.run(f"stat -c %s {quote(ctx.paths.log)} 2>/dev/null || echo 0", timeout=60).stdout.strip()
    offset = int(size) if size.isdigit() else 0
    interval = min(ctx.host.default_poll[0], 1.0)
    while True:
        state = ctx.executor.poll(ctx.paths, (run.pid, run.pid_start or ""), offset, 4 << 20)
        write(state.data)
        offset = state.offset + len(state.data)
        if not state.alive and offset >= state.size:
            return
        sleep(interval)
