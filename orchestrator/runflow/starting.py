"""Starting a run: check, create it with its lease, check its patch sets, free GPUs, apply the sets, prepare,
launch (the host's part is the same for a dry run, see dryrun.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from ..config.hosts import Host
from ..config.spec import RunSpec
from ..config.workspace import Workspace
from ..errors import DatabaseUnavailable, OrchError, UsageError
from ..host import agent, gpu, hostlease, patching
from ..host.executor import executor_class, executor_for
from ..host.hostlease import run_token
from ..host.launch import RunPaths, job_script
from ..host.polling import busy_wait_s
from ..host.remote import Transport, connect, quote
from ..logparse import LogParser, assumption
from ..playbook import Playbook, Prepared, RunContext
from ..store import Store, lease
from ..store.controller import Controller
from ..store.lifecycle import transition
from ..store.record import KILL_GRACE_S, JobRef, Status
from . import cleanup, receipt, registry, watching
from .context import Hosts, Run, open_run, watch_options
from .ending import end, file_states, stop, stop_other
from .look import probe_orphan
from .watching import WatchLock


def check(store: Store, pb: Playbook[Any], spec: RunSpec, host: Host) -> None:
    """Refuse, before anything is touched, input only the registry, the store or the inventory can judge."""
    if spec.nodes > 1 and not pb.multi_node:
        raise UsageError(f"{pb.name} runs on one host; it cannot span {spec.nodes} nodes")
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


# What a start waits for, told to `on_wait`: a run of this workspace (lease.Busy) or another workspace's
# run, as the host's lease files say (hostlease.HostLeaseBusy).
Waiting = lease.Busy | hostlease.HostLeaseBusy


def start(ws: Workspace, store: Store, pb: Playbook[Any], spec: RunSpec, host: Host, *, queue: bool = False,
          on_wait: Callable[[Waiting], None] | None = None,
          run_fields: dict[str, Any] | None = None, replace: bool = False) -> Run:
    """Create the run and take it to `running`; on any failure the run ends `failed` with the reason.

    A run that holds its host is created in the transaction that makes its one `take` of the host's lease
    files (HostTake): a host held by another workspace's run refuses naming it (HostLeaseBusy), one held by a
    run of this workspace raises lease.Busy, either way before any run is made; with queue the same request
    is made again until it is granted; with replace this workspace's holder is stopped instead (see
    `take_replacing`).
    """
    check(store, pb, spec, host)
    if spec.nodes > 1 and not executor_class(host).schedules_gpus:
        raise UsageError(f"nodes = {spec.nodes} needs as many hosts: give --host once per node, or --host @TAG")

    def create() -> int:
        new_id = store.create_run(pb.name, host.name, spec.model_dump(mode="json"))
        # its starter watches it until the launch, so a background watcher waits rather than settles
        store.update_run(new_id, watcher=str(Controller.me()), heartbeat=time.time(), **(run_fields or {}))
        return new_id

    transport = connect(host)
    taken: list[str] | None = None  # the host's take not made yet: prepare makes it
    # On a cluster the queue is the scheduler's: no lease.
    if pb.exclusive and not executor_class(host).schedules_gpus:
        opts = watch_options(pb, spec, host)
        poll = (opts.poll_min, opts.poll_max)
        claim = HostTake(ws, store, [host], {host.name: transport}, spec.gpus)
        if replace:
            [run_id] = take_replacing(ws, store, [host], spec.gpus, lambda: [create()], poll, queue=queue,
                                      on_wait=on_wait, claim=claim)
        else:
            [run_id] = take_leases(ws, store, [host], spec.gpus, lambda: [create()], poll, claim, queue=queue,
                                   on_wait=on_wait)
        taken = claim.taken.get(run_id)
    else:
        with store.tx():
            run_id = create()
    lock = WatchLock(ws, run_id)
    lock.acquire()  # a new run: nobody else can hold it
    (ws.run_dir(run_id) / "spec.json").write_text(
        json.dumps({"playbook": pb.name, "host": host.name, "spec": spec.model_dump(mode="json")}, indent=2)
    )
    transition(store, run_id, Status.PREPARING)
    watching.watch_host_soon(ws, host)
    run: Run | None = None
    try:
        run = open_new(ws, store, pb, spec, host, transport, run_id, lock)
        job = prepare_and_launch(run, taken)
    # A run that never launched has no job, so no phase: it does not pretend to be `starting`.
    except OrchError as exc:
        end(store, run_id, Status.FAILED, f"before launch: {exc}", run, phase=None)
        lock.release()
        raise
    except Exception as exc:  # a bug: the run must not stay `preparing`, and the bug must still show
        end(store, run_id, Status.FAILED, f"before launch: internal error: {type(exc).__name__}: {exc}", run,
            phase=None)
        lock.release()
        raise
    try:
        transition(store, run_id, Status.QUEUED if run.executor.queues else Status.RUNNING,
                   f"{job} on {host.name}", **job.columns())
    except DatabaseUnavailable:
        # the job runs but its record could not say so: a background watcher picks it up from its run dir
        lock.release()
        watching.spawn(ws, run_id)
        raise
    run.refresh()  # launched: the record names its job
    return run


class HostTake:
    """The one lease request a start makes to each host its run holds: `take`, made in the transaction that
    creates the run (lease.acquire_all's claim), in host name order. The host's lease files are taken under
    its lock and the run dir made the run's own, or the request is refused naming the run that holds them
    (lease.HeldByRun for one of this workspace, HostLeaseBusy for another's): the transaction rolls back, so
    no run is made, and a queued start makes the same request again later. `taken`: each run's warnings from
    its host, for `prepare` to record. A host that cannot answer now refuses as it last answered (a run it
    granted this workspace that has not released it), or is left to `prepare`, which asks it again and
    fails the run with the reason."""

    def __init__(self, ws: Workspace, store: Store, hosts: list[Host], transports: Mapping[str, Transport],
                 gpus: list[int] | None):
        self.ws, self.store, self.hosts, self.transports, self.gpus = ws, store, hosts, transports, gpus
        self.taken: dict[int, list[str]] = {}
        self._given: list[tuple[Transport, RunPaths, str]] = []  # what to give back if the runs are not made
        self._silent: set[str] = set()  # hosts whose agent did not start: left to prepare

    def __call__(self, run_ids: list[int]) -> None:
        self.taken, self._given = {}, []  # what an earlier call took stays: its runs were made
        for host, run_id in zip(self.hosts, run_ids, strict=True):
            transport = self.transports[host.name]
            if host.name in self._silent:  # it cannot answer now: what it last granted stands
                held = lease.granted_holder(self.store, [host.name], self.gpus)
                if held is not None:
                    self.give_back()
                    raise lease.HeldByRun(held.lease.run_id, f"{host.name} does not answer; it last granted "
                                                             f"run {held.lease.run_id}, not released since")
                continue
            paths = hostlease.run_paths(self.ws, transport.expand(host.workdir), run_id)
            token = run_token(self.ws, self.store, run_id)
            try:
                self.taken[run_id] = hostlease.take(transport, paths, token, self.gpus)
            except (hostlease.HostLeaseBusy, lease.HeldByRun):
                self.give_back()
                raise
            except OrchError:
                continue  # unreachable, or its files refused: prepare asks again, and the run records why
            self._given.append((transport, paths, token))
            self.store.update_run(run_id, host_lease=1)  # in the transaction: its end releases them

    def give_back(self) -> None:
        """Release what was taken for runs that are not made after all (another host refused, or the
        transaction failed): their lease files and the run dirs made for them."""
        given, self._given, self.taken = self._given, [], {}
        for transport, paths, token in reversed(given):
            try:
                hostlease.release(transport, token)
                hostlease.remove(transport, paths, token)
            except OrchError:
                pass  # the host went away meanwhile: its lease is judged over there (no pid, a run dir gone)

    def made(self, acquire: Callable[[], list[int]]) -> list[int]:
        """`acquire()` (the transaction that calls this claim), with what it took given back if it fails. The
        hosts' agents are started first, so the transaction waits on one request each, never on a connection."""
        self._silent = set()
        for host in self.hosts:
            try:
                agent.shared(self.transports[host.name])
            except OrchError:
                self._silent.add(host.name)
        try:
            return acquire()
        except BaseException:
            self.give_back()
            raise


def take_leases(ws: Workspace, store: Store, hosts: list[Host], gpus: list[int] | None,
                create: Callable[[], list[int]], poll: tuple[float, float], claim: HostTake, *,
                queue: bool = False, on_wait: Callable[[Waiting], None] | None = None,
                sleep: Callable[[float], None] = time.sleep) -> list[int]:
    """The runs' records with their leases, here and on their hosts (`claim`), all or none; refused naming the
    holder, or with queue asked again (every poll[0] s, at most 5 s) until granted."""
    names = [h.name for h in hosts]
    probe = lambda orphan: probe_orphan(ws, store, orphan)
    while True:
        try:
            return claim.made(lambda: lease.acquire_all(store, names, gpus, create, poll[1], probe, claim=claim))
        except (lease.Busy, hostlease.HostLeaseBusy) as busy:
            if not queue or (isinstance(busy, hostlease.HostLeaseBusy) and not busy.held):
                raise  # a lease lock held too long is a host in trouble, not a run to wait for
            if on_wait is not None:
                on_wait(busy)  # may raise to give up waiting
            sleep(busy_wait_s(poll[0]))


def open_new(ws: Workspace, store: Store, pb: Playbook[Any], spec: RunSpec, host: Host, transport: Transport,
             run_id: int, lock: WatchLock | None = None, dry_run: bool = False) -> Run:
    """A run just created, as the flow acts on it: its run dir on the host, and the host's agent started (a
    python that cannot run it fails here)."""
    paths = hostlease.run_paths(ws, transport.expand(host.workdir), run_id)
    agent.shared(transport)
    return Run(ws, store, pb, host, transport, executor_for(host, transport), run_id, spec, paths, lock,
                   dry_run)


def prepare_and_launch(run: Run, taken: list[str] | None = None) -> JobRef:
    """Everything a start does on the host, in order: the steps before the launch, then the launch; the
    job's reference."""
    return launch(run, prepare(run, taken)({}))


def launch(run: Run, script: str) -> JobRef:
    """Start the prepared job: its reference."""
    transition(run.store, run.run_id, Status.LAUNCHING)
    gpus = len(run.spec.gpus) if run.spec.gpus is not None else None
    job = run.executor.launch(run.paths, script, run_token(run.ws, run.store, run.run_id), gpus, run.spec.nodes,
                              facts=receipt.facts_request(run))
    try:
        receipt.launched(run, run.executor.launch_facts)
    except Exception as exc:  # noqa: BLE001 - the job runs: a receipt that cannot be written must not end it
        run.event("warning", f"receipt: {type(exc).__name__}: {exc}")
    return job


def busy_message(store: Store, busy: Waiting, ways_on: bool = True) -> str:
    """Who holds the host, as a person asks it: the run (its playbook, status, phase, for how long) and the
    ways on; the holder's controller only when it is gone while its job runs.
    Another workspace's run is named as the host's lease files name it."""
    if isinstance(busy, hostlease.HostLeaseBusy):
        return f"{busy}; --queue waits for it to end" if ways_on and busy.held else str(busy)
    held = busy.lease
    what = held.describe()
    try:
        holder = store.get_run(held.run_id)
        # a node of a run across hosts holds its own host: named as the run (its head) a person acts on
        run = store.get_run(holder.parent_id) if holder.parent_id is not None else holder
    except OrchError:
        return str(busy)
    doing = f"{run.playbook}, {run.status}" + (f" ({run.phase})" if run.phase and run.status is Status.RUNNING else "")
    since = run.started_at or run.created_at
    if since:
        doing += f" for {_span(time.time() - since)}"
    if holder is not run:
        doing += f", its node {holder.node_rank} on {holder.host}"
    if holder.status.terminal and not lease.holder_alive(held, holder):
        doing += "; whoever ended it is gone, and its host has not shown its job over"
    elif not lease.holder_alive(held, holder):
        doing += f"; its controller is gone but the job still runs: `orch watch {run.id}` follows it"
    verb = "is" if held.gpus is None else "are"
    line = f"{what} {verb} busy with run {run.id} ({doing})"
    if not ways_on:
        return line
    return line + "; --queue waits for it to end, --replace stops it first"


def _span(seconds: float) -> str:
    for unit, size in (("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def take_replacing(ws: Workspace, store: Store, hosts: list[Host], gpus: list[int] | None,
                   create: Callable[[], list[int]], poll: tuple[float, float], *, queue: bool = False,
                   on_wait: Callable[[Waiting], None] | None = None, claim: HostTake) -> list[int]:
    """`--replace`: when a run of this workspace holds its hosts (or GPU set), the new run's records (one per
    host, in the order of `hosts`) are created first, so the holders are stopped through the normal cancel
    path with a reason that names it, a run across several hosts as a whole, through its head; once their
    GPUs are free it takes the leases, all or none. A holder of the same sweep is a sibling point, never
    replaced: it is waited for (queue) or reported like any busy host; another workspace's run is never
    replaced: refused before a run is made, or waited for (queue).
    """
    names = [h.name for h in hosts]
    probe = lambda orphan: probe_orphan(ws, store, orphan)

    def wait(busy: Waiting) -> None:
        if not queue or (isinstance(busy, hostlease.HostLeaseBusy) and not busy.held):
            raise busy
        if on_wait is not None:
            on_wait(busy)  # may raise to give up waiting
        time.sleep(busy_wait_s(poll[0]))

    while True:
        try:
            return claim.made(lambda: lease.acquire_all(store, names, gpus, create, poll[1], probe, claim=claim))
        except lease.Busy:
            break  # a run of this workspace holds them: replaced below
        except hostlease.HostLeaseBusy as busy:
            wait(busy)
    with store.tx():
        run_ids = create()
    runs = [store.get_run(i) for i in run_ids]
    new = next(r for r in runs if r.parent_id is None)
    replaced: set[int] = set()
    try:
        while True:
            try:
                return claim.made(lambda: lease.acquire_all(store, names, gpus, lambda: run_ids, poll[1], probe,
                                                            claim=claim))
            except hostlease.HostLeaseBusy as busy:  # another workspace's run took them meanwhile
                wait(busy)
                continue
            except lease.Busy as busy:
                holder = store.get_run(busy.lease.run_id)
                if holder.parent_id is not None:
                    holder = store.get_run(holder.parent_id)
                if holder.id in replaced:  # stopped, yet it holds on: never a loop
                    raise
                if new.sweep_id is not None and holder.sweep_id == new.sweep_id:
                    wait(busy)
                    continue
                replaced.add(holder.id)
                outcome = replace_run(ws, store, holder.id, new.id, {h.name: h for h in hosts})
                store.add_event(new.id, "replaced", f"run {holder.id} ({holder.playbook}): {outcome}",
                                {"run_id": holder.id})
    except BaseException as exc:
        what = str(exc) if isinstance(exc, OrchError) else f"{type(exc).__name__}: {exc}"
        for run in sorted(runs, key=lambda r: r.parent_id is not None):
            end(store, run.id, Status.FAILED, f"before launch: replacing the holder: {what}")
        raise


def replace_run(ws: Workspace, store: Store, holder_id: int, new_id: int, hosts: Hosts) -> str:
    """Stop a run another replaces: cancelled (its end steps run) naming the new run, then its GPUs free."""
    other = open_run(ws, store, holder_id, hosts, any_spec=True)
    if other.record.status.terminal:
        return f"already {other.record.status}"  # it ended meanwhile; the lease take drops its lease
    return stop(other, reason=f"replaced by run {new_id}")


# The job script of a prepared run, given what its node adds to the environment (a multi-node run's
# rendezvous, known only once every node is prepared; nothing for a run on one host).
Script = Callable[[Mapping[str, str]], str]


def prepare(run: Run, taken: list[str] | None = None) -> Script:
    """The steps before the launch; `taken`: the warnings of the host's take made when the run was created
    (HostTake), None when it is still to be made (a run that does not hold its host claims its run dir)."""
    # Patch sets are checked (read-only) first, so a set that does not apply changes nothing anywhere.
    sets = [registry.patch_set(name, run.ws.root) for name in run.spec.patches]
    python = run.for_playbook().python  # the interpreter the job runs: its install is the one patched
    checked = [patching.check(run.transport, ps, python=python) for ps in sets]
    run.pb.preflight(run.for_playbook())
    # The run dir becomes the run's own (its token) and, for a run that holds its host, another workspace
    # sharing this workdir sees the lease too: before anything changes. Only then is it the run's remote_dir.
    exclusive = run.holds_host
    warnings = taken if taken is not None else hostlease.take(
        run.transport, run.paths, run_token(run.ws, run.store, run.run_id), run.spec.gpus, exclusive)
    for warning in warnings:
        run.event("warning", f"host lease: {warning}")
    run.store.update_run(run.run_id, remote_dir=run.paths.root, **({"host_lease": 1} if exclusive else {}))
    gpu_env = free_gpus(run) if run.spec.cleanup and not run.executor.schedules_gpus else {}
    # On a cluster every job shares the engine install: the sets go to the run's own copy instead.
    overlay = patching.make_overlay(run.transport, run.paths.root, checked) if sets and run.host.scheduler else None
    applied: list[str] = []
    patched: list[dict[str, Any]] = []  # for the receipt: each set and the engine files as it left them
    for ps in sets:
        res = patching.apply(run.transport, ps, run_id=run.run_id, store=run.store, overlay=overlay, python=python)
        applied.append(ps.named_as)  # a folder set by its folder: the end finds it whatever the cwd
        patched.append({"name": ps.named_as, "set_hash": ps.set_hash, "package": res.package, "version": res.version,
                        "files": {f.file: f.sha_after for f in res.files}})
        run.store.update_run(run.run_id, patches_applied=applied)
        where = f" (the run's copy in {overlay.path})" if overlay else (
            f" for {python}" if python != run.host.python else "")
        run.event("patch", f"{ps.name} on {res.package} {res.version}{where}: " + file_states(res),
                  {"applied": ps.name, "set_hash": ps.set_hash, "python": python, "root": res.root,
                   "files": [f.__dict__ for f in res.files]})
    job = run.for_playbook()
    prepared = run.pb.prepare(job)
    note_engine_version(run, prepared.engine_version)
    return partial(_job_script, run, job, prepared, gpu_env, overlay, patched)


def free_gpus(run: Run, *, grace_s: float = KILL_GRACE_S, timeout_s: float = gpu.CLEANUP_TIMEOUT_S,
              sleep: Callable[[float], None] = time.sleep) -> dict[str, str]:
    """The GPU cleanup step: earlier runs on the GPUs are cancelled (and finished) first; the job's
    CUDA_VISIBLE_DEVICES."""
    return cleanup.before_launch(run.transport, run.store, run.run_id, run.spec.gpus, run.spec.kill_foreign,
                                 run.event, lambda other, reason: stop_other(run, other, reason, grace_s),
                                 grace_s=grace_s, timeout_s=timeout_s, sleep=sleep,
                                 seen=lambda snap: receipt.gpus_checked(run, snap))


def note_engine_version(run: Run, version: str | None) -> None:
    """The installed engine's version, for the log's reading (what a line's layout does not tell), and one
    warning when orch's tables were not taken from it (what it assumes instead)."""
    if version is None:
        return
    engine = run.pb.log_engine(run.spec)
    parser = LogParser(engine=engine, ready_pattern=run.pb.ready_pattern(run.spec), engine_version=version)
    run.store.update_run(run.run_id, parser_state=parser.to_dict())
    assumed = assumption(engine, version)
    if assumed is not None:
        run.event("warning", assumed)


def _job_script(run: Run, view: RunContext[Any], prepared: Prepared, gpu_env: dict[str, str],
                overlay: patching.Overlay | None, patched: list[dict[str, Any]], node_env: Mapping[str, str]) -> str:
    """The job's environment (host, spec, GPUs, what prepare added, then its node's), working dir and
    command lines."""
    env = {**run.host.env, **run.spec.env, **gpu_env, **prepared.env, **node_env}
    body = run.pb.command(view, prepared)
    receipt.begin(run, view, prepared, body, env, patched)
    if overlay is not None:  # the patched copies come before the install, whatever PYTHONPATH held
        body = f"export PYTHONPATH={quote(overlay.path)}${{PYTHONPATH:+:$PYTHONPATH}}\n{body}"
    return job_script(body, env, run.pb.cwd(run.spec))
