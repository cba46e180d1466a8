"""How a playbook runs: cleanup → patch → prepare → launch under nohup → watch → finish.

A playbook supplies its Spec class and three small steps (`prepare`, `command`, `finish`); this module
owns the order, the lifecycle transitions and what is recorded.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from . import launch, lease, notify
from .errors import OrchError, UsageError
from .hosts import Host
from .launch import RunPaths
from .lifecycle import Status, transition
from .remote import Result, Transport, connect
from .spec import RunSpec, stored
from .store import Store
from .watch import Watcher, WatchOptions
from .workspace import Workspace


@dataclass
class RunContext:
    ws: Workspace
    store: Store
    host: Host
    transport: Transport
    run_id: int
    spec: RunSpec
    paths: RunPaths
    env: dict[str, str] = field(default_factory=dict)  # added by steps, e.g. CUDA_VISIBLE_DEVICES
    launch_args: list[str] = field(default_factory=list)  # added by steps, e.g. flags a patch requires

    @property
    def python(self) -> str:
        return self.spec.python or self.host.python

    def event(self, kind: str, message: str, data: Any = None) -> None:
        self.store.add_event(self.run_id, kind, message, data)


class Playbook:
    name: ClassVar[str]
    Spec: ClassVar[type[RunSpec]]
    engine: ClassVar[str | None] = None  # log format hint for the watcher
    # Holds its host (or GPU set) while it runs; a client of a server on that host (a benchmark) does not.
    exclusive: ClassVar[bool] = True

    def prepare(self, ctx: RunContext) -> None:
        """Upload what the job needs into its run dir."""

    def command(self, ctx: RunContext) -> str:
        """The job's shell command lines (values quoted)."""
        raise NotImplementedError

    def cwd(self, ctx: RunContext) -> str | None:
        return None

    def engine_argv(self, spec: RunSpec) -> list[str] | None:
        """The engine's command line, to check the flags a patch set requires; None: not an engine launch."""
        return None

    def ready_pattern(self, spec: RunSpec) -> str | None:
        return getattr(spec, "ready_pattern", None)

    def log_engine(self, spec: RunSpec) -> str | None:
        """Log format hint for this spec (a playbook with several backends prints several formats)."""
        return self.engine

    def health(self, spec: RunSpec, host: Host) -> Callable[[Transport], int | None] | None:
        """A server's health probe (see health.py), asked on each poll while it is ready; None: no endpoint."""
        return None

    def check_inputs(self, store: Store, spec: RunSpec, host: Host) -> None:
        """Refuse (UsageError) input that only the store or the inventory can judge, before the run exists."""

    def finish(self, ctx: RunContext, run: dict[str, Any]) -> None:
        """Collect outputs and metrics after the job ended."""


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


def watch_options(playbook: Playbook, spec: RunSpec, host: Host, until_ready: bool = False) -> WatchOptions:
    lo, hi = host.default_poll
    lo = spec.poll_min or lo
    hi = max(spec.poll_max or hi, lo)
    return WatchOptions(
        poll_min=lo,
        poll_max=hi,
        until_ready=until_ready,
        ready_pattern=playbook.ready_pattern(spec),
        engine=playbook.log_engine(spec),
        stall_factor=spec.stall_factor,
        on_stall=spec.on_stall,
        health=playbook.health(spec, host),
        health_grace_s=getattr(spec, "health_grace_s", None) or WatchOptions.health_grace_s,
    )


def _steps_before_launch(pb: Playbook, ctx: RunContext) -> str:
    from . import patching

    # Patch sets are checked (read-only) first, so a set that does not apply changes nothing anywhere.
    sets = [patching.load(name) for name in ctx.spec.patches]
    for ps in sets:
        patching.check(ctx.transport, ps)
    if ctx.spec.cleanup:
        from . import gpu

        gpu.cleanup_step(ctx)
    for ps in sets:
        res = patching.apply(ctx.transport, ps, run_id=ctx.run_id, store=ctx.store)
        ctx.event("patch", f"{ps.name} on {res.package} {res.version}: " + _file_states(res),
                  {"applied": ps.name, "set_hash": ps.set_hash, "files": [f.__dict__ for f in res.files]})
    pb.prepare(ctx)
    return _job_script(pb, ctx)


def _job_script(pb: Playbook, ctx: RunContext) -> str:
    """The job's environment (host, spec, then what the steps added), working dir and command lines."""
    env = {**ctx.host.env, **ctx.spec.env, **ctx.env}
    return launch.job_script(pb.command(ctx), env, pb.cwd(ctx))


def _file_states(res: Any) -> str:
    return ", ".join(f"{f.file} {f.state}" for f in res.files)


def dry_run(ws: Workspace, store: Store, pb: Playbook, spec: RunSpec, host: Host,
            echo: Callable[[str], None]) -> None:
    pb.check_inputs(store, spec, host)
    transport = DryRunTransport(host, echo)
    next_id = (store.conn.execute("SELECT COALESCE(MAX(id), 0) + 1 FROM runs").fetchone()[0])
    paths = RunPaths.for_run(transport.expand(host.workdir), next_id)
    ctx = RunContext(ws, store, host, transport, next_id, spec, paths)
    pb.prepare(ctx)
    script = _job_script(pb, ctx)
    echo(f"# job.sh for run {next_id}:\n{script}")
    transport.run(launch.launch_command(paths, script, run_token(ws, store, next_id)))


def run_token(ws: Workspace, store: Store, run_id: int) -> str:
    """Names this run of this workspace in its remote dir, so another workspace's run N is not taken for it."""
    created = store.conn.execute("SELECT created_at FROM runs WHERE id = ?", (run_id,)).fetchone()
    return f"{socket.gethostname()}:{ws.db_path}:{run_id}:{created[0] if created else 0}"


def start(ws: Workspace, store: Store, pb: Playbook, spec: RunSpec, host: Host, *, queue: bool = False,
          on_wait: Callable[[lease.Busy], None] | None = None,
          run_fields: dict[str, Any] | None = None) -> RunContext:
    """Create the run and take it to `running`; on any failure the run ends `failed` with the reason.

    The run is created together with its lease on the host (or its GPU set): a busy host raises
    lease.Busy naming the holder, or with queue waits for it.
    """
    check_patch_flags(pb, spec)
    pb.check_inputs(store, spec, host)

    def create() -> int:
        new_id = store.create_run(pb.name, host.name, spec.model_dump(mode="json"))
        store.update_run(new_id, **(run_fields or {}))
        return new_id

    opts = watch_options(pb, spec, host)
    if pb.exclusive:
        run_id = lease.take(store, host.name, spec.gpus, create, (opts.poll_min, opts.poll_max), queue=queue,
                            on_wait=on_wait, probe=lambda run: lease.probe_orphan(ws, store, run))
    else:
        with store.tx():
            run_id = create()
    (ws.run_dir(run_id) / "spec.json").write_text(
        json.dumps({"playbook": pb.name, "host": host.name, "spec": spec.model_dump(mode="json")}, indent=2)
    )
    transition(store, run_id, Status.PREPARING)
    ctx: RunContext | None = None
    try:
        transport = connect(host)
        paths = RunPaths.for_run(transport.expand(host.workdir), run_id)
        store.update_run(run_id, remote_dir=paths.root)
        ctx = RunContext(ws, store, host, transport, run_id, spec, paths)
        script = _steps_before_launch(pb, ctx)
        transition(store, run_id, Status.LAUNCHING)
        pid, pid_start = launch.launch(transport, paths, script, run_token(ws, store, run_id))
    except OrchError as exc:
        transition(store, run_id, Status.FAILED, f"before launch: {exc}")
        if ctx is not None:
            after_end(pb, ctx)
        lease.release(store, run_id)
        raise
    transition(store, run_id, Status.RUNNING, f"pid {pid} on {host.name}", pid=pid, pid_start=pid_start)
    return ctx


def context_for(ws: Workspace, store: Store, pb: Playbook, run: dict[str, Any], host: Host) -> RunContext:
    spec = stored(pb.Spec, run)  # one line naming the run when its stored spec is unreadable
    transport = connect(host)
    root = run["remote_dir"] or RunPaths.for_run(transport.expand(host.workdir), run["id"]).root
    return RunContext(ws, store, host, transport, run["id"], spec, RunPaths(root))


def watch(ctx: RunContext, pb: Playbook, *, until_ready: bool = False,
          on_update: Callable[[Watcher], None] | None = None,
          sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    opts = watch_options(pb, ctx.spec, ctx.host, until_ready)
    watcher = Watcher(ctx.store, ctx.run_id, ctx.transport, opts, on_update=on_update, sleep=sleep)
    run = watcher.run_until_done()
    if Status(run["status"]).terminal:
        after_end(pb, ctx)
        run = ctx.store.get_run(ctx.run_id)
    return run


def after_end(pb: Playbook, ctx: RunContext) -> None:
    """What happens once whatever the end: outputs, the log tail, reverting patches. Never raises."""
    done = {e["message"] for e in ctx.store.events(ctx.run_id) if e["kind"] == "finished"}
    steps: list[tuple[str, Callable[[], None]]] = [
        ("outputs", lambda: pb.finish(ctx, ctx.store.get_run(ctx.run_id))),
        ("log tail", lambda: fetch_log_tail(ctx)),
        ("patch revert", lambda: revert_patches(ctx)),
        ("notify", lambda: notify.run_ended(ctx)),  # starts a daemon thread; never waits for the receiver
    ]
    for name, step in steps:
        if name in done:
            continue
        try:
            step()
            ctx.event("finished", name)
        except OrchError as exc:
            ctx.event("warning", f"{name}: {exc}")
    if Status(ctx.store.get_run(ctx.run_id)["status"]).terminal:
        lease.release(ctx.store, ctx.run_id)  # the host (or GPU set) is free for the next run


def fetch_log_tail(ctx: RunContext, lines: int = 200) -> None:
    run = ctx.store.get_run(ctx.run_id)
    if not ctx.paths.root or (not run["pid"] and run["status"] != Status.LOST):
        return  # never launched: there is no log (and a host that failed the start is not asked again)
    text = ctx.transport.run(launch.tail_command(ctx.paths, lines)).stdout
    (ctx.ws.run_dir(ctx.run_id) / "log.tail").write_text(text)


def check_patch_flags(pb: Playbook, spec: RunSpec) -> None:
    """Refuse, before anything is touched, a run whose patch sets need flags its command lacks."""
    from . import patching

    for name in spec.patches:
        ps = patching.load(name)
        if not ps.requires_flags:
            continue
        argv = pb.engine_argv(spec)
        missing = patching.missing_flags(ps, argv) if argv is not None else list(ps.requires_flags)
        if missing:
            raise UsageError(f"patch set {name} needs {' '.join(missing)} in the launch command "
                             f"(debug code does not run under CUDA graph replay)")


def revert_patches(ctx: RunContext) -> None:
    from . import patching

    applied = {(e["data"] or {}).get("applied") for e in ctx.store.events(ctx.run_id) if e["kind"] == "patch"}
    for name in ctx.spec.patches:
        ps = patching.load(name)
        if ps.revert_after and name in applied:
            res = patching.revert(ctx.transport, ps, run_id=ctx.run_id, store=ctx.store)
            ctx.event("patch", f"{name} reverted: " + _file_states(res))
