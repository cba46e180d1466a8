"""Every way a run ends reaches `finish`: the end steps once whoever ends it; its lease is freed as soon as
the host can take the next run."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from ..config.workspace import Workspace
from ..errors import OrchError, TransitionError, Unreachable
from ..host import gpu, hostlease, patching
from ..host.hostlease import run_token
from ..store import Store, lease
from ..store.db import claim_alive
from ..store.lifecycle import transition
from ..store.record import KILL_GRACE_S, RunRecord, Status
from ..store.shapes import unreachable_since
from . import cleanup, notify, receipt, registry
from .context import END_STEPS, LOG_TAIL_LINES, Hosts, Run, open_run
from .lastread import END_WAIT_S, read_to_end


def end(store: Store, run_id: int, status: Status, message: str, run: Run | None = None,
        **fields: Any) -> RunRecord:
    """End a run the watcher did not end itself, then finish it (a run never opened only frees its lease)."""
    transition(store, run_id, status, message, **fields)
    if run is None:
        lease.release(store, run_id)
        return store.get_run(run_id)
    return finish(run)


def finish(run: Run) -> RunRecord:
    """The end steps of an ended run, each at most once whoever calls; its lease is freed as soon as the
    steps that must precede the host's next run are done (lease.BEFORE_RELEASE: the log read to its end, the
    patch revert), and the others (outputs, log tail, notify) run after that.

    A step is claimed in the record before it runs, so two processes finishing the same run never both
    run it; one claimed elsewhere and still under way before release is awaited, so the lease is never freed
    under it and whoever returns from here finds the log read to its end. A step that fails is a warning
    event; the others still run.
    """
    if not run.refresh().status.terminal:
        return run.record
    finishing = _FINISHING.set(_FINISHING.get() | {run.run_id})
    try:
        end_nodes(run)
    finally:
        _FINISHING.reset(finishing)
    try:
        while True:
            for name in lease.BEFORE_RELEASE:
                _step(run, name)  # unclaimed, or claimed by a process that died: done here
            if not _await_steps_elsewhere(run.store, [run.record]):
                break
        run.refresh()
    finally:
        _release_host(run)
        lease.release(run.store, run.run_id)  # the host (or GPU set) is free for the next run
    for name in END_STEPS:
        if name not in lease.BEFORE_RELEASE:
            _step(run, name)
    return run.refresh()


def _step(run: Run, name: str) -> None:
    steps: dict[str, Callable[[Run], None]] = {
        "stop": _stop_lingering, "log to end": read_to_end, "outputs": _collect_outputs, "log tail": _fetch_log_tail,
        "patch revert": _revert_patches, "notify": _notify,
    }
    claim = _claim_step(run.store, run.run_id, name)
    if claim is None:
        return
    if claim == "taken over":
        run.event("end step", f"{name}: taken over (whoever had claimed it died before it was done)")
    try:
        steps[name](run)
        run.event("finished", name)  # for the timeline; the record's end_steps is what counts
    except Exception as exc:  # noqa: BLE001 - one step's failure must not skip the others
        what = str(exc) if isinstance(exc, OrchError) else f"{type(exc).__name__}: {exc}"
        run.event("warning", f"{name}: {what}")
    finally:
        run.store.end_step_over(run.run_id, name)


STEPS_ELSEWHERE_S = END_WAIT_S + 60  # the end's read may wait END_WAIT_S for the job; then reads and records
STEP_LOOK_S = 0.1


def _await_steps_elsewhere(store: Store, runs: list[RunRecord], sleep: Callable[[float], None] = time.sleep) -> bool:
    """Wait while another process does a step before release of these runs (the host's watcher reading the
    log while this one stopped the job; another node's whole end). Only while a run holds its lease: once
    freed (the steps over, or the wait ran out once), nobody waits again. True when it stopped because a
    step's claimer died before the step was over: the step is to be taken over."""
    deadline = time.monotonic() + STEPS_ELSEWHERE_S

    def under_way(run: RunRecord) -> bool:  # its lease first: freed, nothing is left to wait for
        return any(held.run_id == run.id for held in lease.held(store, run.host)) and not (
            lease.steps_before_release_done(store, run))

    while time.monotonic() < deadline:
        waiting = [run for run in runs if under_way(run)]
        if not waiting:
            return False
        if any(_abandoned(store.get_run(run.id)) for run in waiting):
            return True
        sleep(STEP_LOOK_S)
    return False


def _abandoned(run: RunRecord) -> bool:
    """Whether a step before release of the run was claimed by a process that died before it was over."""
    return any(name in run.end_claims and not claim_alive(run.end_claims[name]) for name in lease.BEFORE_RELEASE)


def _release_host(run: Run) -> None:
    """Drop the run's lease files on its host; one left behind (the host unreachable) goes stale with the run."""
    if not run.record.host_lease:
        return
    try:
        hostlease.release(run.transport, run_token(run.ws, run.store, run.run_id))
        run.store.update_run(run.run_id, host_lease=0)
    except OrchError:
        pass


def _claim_step(store: Store, run_id: int, name: str) -> str | None:
    """Record that the step runs now (see Store.claim_end_step); None when it already ran (or runs elsewhere)."""
    return store.claim_end_step(run_id, name)


def failed_running(record: RunRecord) -> bool:
    """Whether the run failed while its job ran (a fatal line, a stall acted on, a node's rank): its end
    steps stop what is left of the job."""
    return record.status is Status.FAILED and record.exit_code is None and record.launched


def _stop_lingering(run: Run) -> None:
    """What is left of a job that failed while running is stopped, provably its own, so its GPUs are freed.
    An end step, so that a finisher that died midway (the grace is seconds) has it done by the next one."""
    job = run.record.job
    if job is not None and failed_running(run.record):
        outcome = run.executor.kill(job, KILL_GRACE_S)
        if outcome != "gone":
            run.event("stopped", f"process group: {outcome}")


def _collect_outputs(run: Run) -> None:
    record = run.refresh()  # as the log's last bytes left it
    outputs = run.pb.finish(run.for_playbook(), record)
    if outputs.manifest is not None:
        (run.ws.run_dir(run.run_id) / "outputs.json").write_text(json.dumps(outputs.manifest, indent=2))
    if outputs.metrics:
        run.store.add_metrics(run.run_id, [(n, v, None) for n, v in outputs.metrics], record.ended_at or 0)


def _fetch_log_tail(run: Run) -> None:
    record = run.record
    if not record.launched and record.status is not Status.LOST:
        return  # never launched: there is no log (and a host that failed the start is not asked again)
    (run.ws.run_dir(run.run_id) / "log.tail").write_text(run.executor.tail(run.paths, LOG_TAIL_LINES))


def _revert_patches(run: Run) -> None:
    reverted: list[str] = []
    try:
        _revert(run, reverted)
    finally:
        receipt.complete(run, reverted)  # the receipt says which sets were undone, whatever failed


def _revert(run: Run, reverted: list[str]) -> None:
    if run.host.scheduler:  # the sets went to the run's own overlay; the install never changed
        return
    python = run.for_playbook().python  # the interpreter the sets were applied for
    for name in run.record.patches_applied:
        try:
            ps = registry.patch_set(name, run.ws.root)
        except patching.PatchError as exc:  # a folder of the user's, moved or broken since: the others go on
            run.event("warning", f"patch revert: {exc}; if it was to be undone: orch patch revert "
                                 f"{name.rstrip('/').rsplit('/', 1)[-1]} --host {run.host.name}")
            continue
        if ps.revert_after:
            res = patching.revert(run.transport, ps, run_id=run.run_id, store=run.store, python=python)
            run.event("patch", f"{ps.name} reverted: " + file_states(res))
            reverted.append(name)


def notification(store: Store, run: RunRecord) -> dict[str, Any]:
    """What a run's notification says: who, where, how it ended, and its latest metrics — also as one
    line of `text` (and `content`), the fields chat webhooks (Slack, Teams; Discord) display."""
    metrics = store.latest_metrics(run.id)
    line = notify.summary(f"orch run {run.id} ({run.playbook} on {run.host}) {run.status.value}",
                          run.reason if run.status is not Status.SUCCEEDED else None, metrics)
    return {
        "event": "run.ended", "run_id": run.id, "playbook": run.playbook, "host": run.host,
        "status": run.status.value, "error_kind": (run.error or {}).get("kind"), "reason": run.reason,
        "metrics": metrics, "started_at": run.started_at, "ended_at": run.ended_at, "text": line, "content": line,
    }


def _notify(run: Run) -> None:
    if not run.spec.notify or run.record.parent_id is not None:  # a run across hosts is told of once, by its head
        return
    db_path, run_id = run.store.path, run.run_id

    def record(url: str, message: str) -> None:
        own = Store(db_path)  # from the sender's thread: a connection of its own, never the run's
        try:
            own.add_event(run_id, "warning", f"notify {url}: {message}")
        finally:
            own.close()

    # a daemon thread: never waits for the receiver
    notify.send(run.spec.notify, notification(run.store, run.refresh()), record, total_s=run.spec.notify_timeout_s)


def cancel(run: Run, reason: str, grace_s: float = KILL_GRACE_S, status: Status = Status.CANCELLED) -> str:
    """Decide (the run is cancelled, or ends with `status`), stop its process group, finish it. Returns what
    happened to the group.

    The decision is recorded first, so a watcher that sees the processes vanish finds it already made
    instead of calling the run lost. A launched run is `cancelling` until its job is proven stopped: when
    its host does not answer it stays so, its lease held, and this says so at once (see complete_cancel).
    """
    record = run.refresh()
    if record.status.terminal:
        raise OrchError(f"run {record.id} already ended ({record.status})")
    if record.job is None:  # nothing runs anywhere: it ends now
        transition(run.store, run.run_id, status, reason)
        finish(run)
        return "never started"
    if record.status is not Status.CANCELLING:  # (cancelled again: the first decision stands)
        transition(run.store, run.run_id, Status.CANCELLING, reason, reason=reason, ending_as=status.value)
    return complete_cancel(run, grace_s)


def complete_cancel(run: Run, grace_s: float = KILL_GRACE_S, look_first: bool = True) -> str:
    """Stop a cancelling run's job, end the run as decided and finish it; what happened to its group.

    A host that does not answer leaves the run cancelling, its lease held (the job may run on when the host
    returns): its watcher completes the stop once it answers. With `look_first`, a host its watcher already
    found silent is not tried (that would take minutes of retries): said at once.
    """
    record = run.refresh()
    if record.status is not Status.CANCELLING or record.job is None:
        return f"already {record.status.value}"
    silent = unreachable_since(run.store, record) if look_first else None
    if silent is not None:
        return _still_cancelling(run, f"host {record.host} does not answer (it has not answered for "
                                      f"{max(0.0, time.time() - silent):.0f} s)")
    # The stop is the end step `stop`, claimed: of two completers (the canceller, and the host's watcher that
    # reconnected meanwhile) one signals the job and records it; the other leaves it to that one.
    if _claim_step(run.store, run.run_id, "stop") is None:
        return _await_stop_elsewhere(run, grace_s)
    try:
        outcome = run.executor.kill(record.job, grace_s)
    except (Unreachable, OrchError) as exc:  # its agent could not say the job stopped: no end on a guess
        run.store.unclaim_end_step(run.run_id, "stop")  # the next try (its watcher's, once it answers) does it
        why = (f"host {record.host} does not answer ({exc.reason})" if isinstance(exc, Unreachable)
               else f"the stop failed on host {record.host}: {exc}")
        return _still_cancelling(run, why)
    run.event("stopped", f"process group: {outcome}")
    run.event("finished", "stop")
    run.store.end_step_over(run.run_id, "stop")
    try:
        transition(run.store, run.run_id, Status(record.ending_as or Status.CANCELLED), record.reason or "cancelled")
    except TransitionError:
        pass  # its watcher saw the job end first, and recorded it as decided
    finish(run)
    return outcome


def _await_stop_elsewhere(run: Run, grace_s: float) -> str:
    """Another process has the cancelled run's stop: until it ended the run (then finished here too, as any
    finisher awaits the others' steps) or gave up (the run stays cancelling); taken over if it died."""
    deadline = time.monotonic() + grace_s + STEPS_ELSEWHERE_S
    while time.monotonic() < deadline:
        record = run.refresh()
        if record.status.terminal:
            finish(run)
            return "stopped by another orch process"
        if record.status is not Status.CANCELLING or "stop" not in record.end_steps:
            return f"not stopped by another orch process: the run is {record.status.value}"
        if "stop" in record.end_claims and not claim_alive(record.end_claims["stop"]):
            return complete_cancel(run, grace_s, look_first=False)  # its claimer died midway: taken over
        time.sleep(STEP_LOOK_S)
    return "still being stopped by another orch process"


def _still_cancelling(run: Run, why: str) -> str:
    said = (f"not stopped yet: {why}; the run stays cancelling, its host held, until the host answers and its "
            "job is stopped")
    run.event("cancelling", said)
    return said


def stop(run: Run, grace_s: float = KILL_GRACE_S, sleep: Callable[[float], None] = time.sleep,
         timeout_s: float = gpu.CLEANUP_TIMEOUT_S, reason: str = "stopped by user") -> str:
    """End a run (a server, usually) and leave its GPUs free: cancel it, then wait until its GPUs are free.

    The run is cancelled even when its GPUs then stay busy (that raises, naming what holds them).
    """
    outcome = cancel(run, reason, grace_s)
    if run.refresh().status is Status.CANCELLING:  # its host did not answer: nothing to wait for yet
        return outcome
    if run.executor.schedules_gpus:
        return f"{run.record.job or 'its job'} {outcome}; its GPUs are the scheduler's to free"
    freed = cleanup.after_stop(run.transport, run.record, run.spec.gpus, run.event, grace_s=grace_s, timeout_s=timeout_s,
                               sleep=sleep)
    return f"process group {outcome}; {freed}"


# The runs whose finish this thread is in (a node's finish may end its head, and the head's its nodes).
_FINISHING: ContextVar[frozenset[int]] = ContextVar("finishing", default=frozenset())
NODES_GRACE_S = 30.0  # after the head's job ended well, how long the other nodes have to end by themselves
NODES_LOOK_S = 0.2


def end_nodes(run: Run, sleep: Callable[[float], None] = time.sleep) -> None:
    """A multi-node run ends as one, whichever of its nodes ends first and whoever saw it. A node that ended
    otherwise than well (a fatal line, an exit, lost, cancelled) fails the run: its head is ended failed,
    naming the node, and stopped. The head's end stops every other node still running; after a head that
    ended well they have NODES_GRACE_S to end by themselves first (torchrun's ranks end together)."""
    record = run.record
    if record.node_rank is None:
        return
    nodes = run.store.nodes_of(record.id)
    if not nodes:
        return
    head = nodes[0]
    # Before the head launched, the nodes are their starter's to end (nodes.py); a node that never launched
    # while the head did (its starter died between the two) leaves the head waiting for it: it ends the run.
    if record.id != head.id:
        # (a head already cancelling is being stopped by whoever decided it first)
        if record.status is not Status.SUCCEEDED and head.launched and not _ending(head):
            why = f": {record.reason}" if record.reason else ""
            _end_node(run, head, Status.FAILED, f"node {record.node_rank} ({record.host}) {record.status.value}{why}")
        return
    others = [n for n in nodes[1:] if n.launched]
    deadline = time.monotonic() + (NODES_GRACE_S if record.status is Status.SUCCEEDED else 0)
    while any(not n.status.terminal for n in others) and time.monotonic() < deadline:
        sleep(NODES_LOOK_S)
        others = [run.store.get_run(n.id) for n in others]
    for node in others:
        if not node.status.terminal:  # (one cancelling elsewhere is stopped here too: its end is awaited below)
            _end_node(run, node, Status.CANCELLED, f"the run ended on its head node ({record.status.value})")
    # A node ended elsewhere (its host's watcher saw it first) is finished there: awaited, so whoever returns
    # from the head's end (a stop, a --replace) finds every node's host free; but never one whose own finish
    # led here (a node that failed ends its head from within its finish, before its lease is freed).
    # (a node left cancelling, its host silent, holds its lease until its watcher stops it: not awaited)
    awaited = [n for n in map(run.store.get_run, [o.id for o in others])
               if n.id not in _FINISHING.get() and n.status.terminal]
    if _await_steps_elsewhere(run.store, awaited, sleep):
        for node in awaited:  # whoever was finishing it died: finished here
            if _abandoned(run.store.get_run(node.id)):
                finish(open_run(run.ws, run.store, node.id, any_spec=True))


def _ending(run: RunRecord) -> bool:
    """Ended, or decided to end (cancelling: whoever decided it stops its job)."""
    return run.status.terminal or run.status is Status.CANCELLING


def _end_node(run: Run, node: RunRecord, status: Status, reason: str) -> None:
    """End another node of the run, through the same path as any cancel: its process group stopped and its end
    steps run. One that ended meanwhile is left as it ended."""
    try:
        cancel(open_run(run.ws, run.store, node.id, any_spec=True), reason, status=status)
    except TransitionError:
        pass  # it ended on its own meanwhile
    except OrchError as exc:
        if not run.store.get_run(node.id).status.terminal:
            run.event("warning", f"node {node.node_rank} ({node.host}) not ended: {exc}")


def abandon(store: Store, run_id: int, reason: str) -> RunRecord:
    """End a run orch can no longer reach (its host left the inventory): cancelled without touching any
    host, its lease freed; the reason says its job was not stopped."""
    run = store.get_run(run_id)
    if run.status.terminal:
        raise OrchError(f"run {run.id} already ended ({run.status})")
    return end(store, run_id, Status.CANCELLED, reason)


def stop_quietly(ws: Workspace, store: Store, run_id: int, reason: str, hosts: Hosts | None = None,
                 grace_s: float = KILL_GRACE_S) -> str:
    """Cancel a run for a caller that goes on whatever happens (a sweep); what happened, in words."""
    try:
        return cancel(open_run(ws, store, run_id, hosts, any_spec=True), reason, grace_s)
    except OrchError as exc:  # it ended meanwhile, or its host cannot be reached
        return str(exc)


def stop_other(run: Run, run_id: int, reason: str, grace_s: float) -> str:
    """GPU cleanup found an earlier run of this workspace on the GPUs: it ends like any run."""
    other = open_run(run.ws, run.store, run_id, {run.host.name: run.host}, any_spec=True)
    record = other.record
    if not record.status.terminal:
        try:
            return cancel(other, reason, grace_s)
        except TransitionError:
            record = other.refresh()  # it ended on its own meanwhile
    if record.job is None:
        return "gone"
    return other.executor.kill(record.job, grace_s)  # ended, but still on the GPUs


def file_states(res: Any) -> str:
    return ", ".join(f"{f.file} {f.state}" for f in res.files)


_WHOSE = {"other": "another run's", "none": "no run's (no token)"}


def settle_orphan(run: Run) -> RunRecord:
    """A run whose controller died: end it when it never launched, pick up its pid when the launch got
    that far; a running one is left as it is. Returns the run as it is now."""
    record = run.refresh()
    if record.status.terminal or record.status.live:
        return record
    if record.status is Status.LAUNCHING and record.remote_dir:
        # the job may have started: its run dir says so (the wrapper's pid file, the scheduler's job id) —
        # when the dir is this run's; a pid in another run's dir is never adopted, nor ever signalled
        whose = hostlease.owner(run.transport, run.paths, run_token(run.ws, run.store, run.run_id))
        if whose in ("other", "none"):
            return _end_orphan(run, Status.FAILED, f"its controller died while launching; its run dir "
                               f"{run.paths.root} is {_WHOSE[whose]}", phase=None)
        job = run.executor.find(run.paths) if whose == "mine" else None
        if job is not None:
            try:
                transition(run.store, run.run_id, Status.QUEUED if run.executor.queues else Status.RUNNING,
                           "picked up after its controller died", **job.columns())
            except TransitionError:
                if run.refresh().status is Status.LAUNCHING:
                    raise
                return run.record  # picked up meanwhile by another process (its host's watcher, a resumed sweep)
            return run.refresh()
        return _end_orphan(run, Status.LOST, "its controller died while launching; no job pid was written")
    return _end_orphan(run, Status.FAILED, f"its controller died before launch ({record.status})", phase=None)


def _end_orphan(run: Run, status: Status, message: str, **fields: Any) -> RunRecord:
    """End a run whose controller died, unless another process that found it so (its host's watcher, a
    resumed sweep, a `status`) ended it first: then it is theirs to finish, and it is returned as it is."""
    try:
        return end(run.store, run.run_id, status, message, run, **fields)
    except TransitionError:
        if not run.refresh().status.terminal:
            raise
        return run.record
