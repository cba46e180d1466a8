"""The run flow's GPU step: free the GPUs a run needs before its launch, and after a stop.

Stale orch runs on those GPUs are stopped through the caller's `stop_run` (so they end like any run,
with their end steps); processes orch did not start are refused unless the spec says `kill_foreign`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..errors import OrchError
from ..host import gpu
from ..host.gpu import GpuProcess, GpuSnapshot, indices_text
from ..host.remote import Transport
from ..store import Store
from ..store.record import KILL_GRACE_S, RunRecord

Event = Callable[[str, str, object], None]  # (kind, message, data)
StopRun = Callable[[int, str], str]  # (run id, reason) -> what happened


def before_launch(transport: Transport, store: Store, run_id: int, gpus: list[int] | None, kill_foreign: bool,
                  event: Event, stop_run: StopRun, *, grace_s: float = KILL_GRACE_S,
                  timeout_s: float = gpu.CLEANUP_TIMEOUT_S, sleep: Callable[[float], None] = time.sleep,
                  seen: Callable[[GpuSnapshot], None] | None = None) -> dict[str, str]:
    """Free the GPUs the run needs and wait until they are empty; the job's CUDA_VISIBLE_DEVICES. `seen` gets
    the last look, with the GPUs' facts (the receipt's: the launch need not ask nvidia-smi again)."""
    snap = gpu.snapshot(transport)
    if snap is None:
        event("gpu", "no nvidia-smi: CPU host", None)
        return {"CUDA_VISIBLE_DEVICES": indices_text(gpus)} if gpus is not None else {}
    gpu.attribute(snap, store, transport.host.name)
    selected = gpu.selected_gpus(snap, gpus)
    event("gpu", f"before cleanup of GPUs {indices_text(selected) or 'none'}", gpu.snapshot_to_dict(snap))
    holders = snap.processes(selected)
    foreign = [p for p in holders if p.run_id is None]
    if foreign and not kill_foreign:
        raise OrchError(
            f"GPUs held by processes orch did not start: {gpu.foreign_list(foreign)}; "
            "stop them, choose other GPUs (gpus = [...]) or set kill_foreign = true"
        )
    reason = f"stopped by run {run_id} to free GPUs {indices_text(selected)}"
    for other in sorted({p.run_id for p in holders if p.run_id is not None}):
        outcome = stop_run(other, reason)
        event("gpu", f"stopped run {other} ({outcome}): {reason}", None)
        _kill_leftovers(transport, store.get_run(other), [p for p in holders if p.run_id == other], event, grace_s)
    if foreign:
        outcome = gpu.kill_pids(transport, gpu.unique(foreign), grace_s)
        event("gpu", f"killed foreign processes ({outcome}): {gpu.foreign_list(foreign)}", None)
    after = gpu.wait_until_free(transport, selected, timeout_s=timeout_s, sleep=sleep, facts=seen is not None)
    if seen is not None:
        seen(after)
    event("gpu", f"GPUs {indices_text(selected) or 'none'} free", gpu.snapshot_to_dict(after))
    return {"CUDA_VISIBLE_DEVICES": indices_text(selected)} if selected else {}


def after_stop(transport: Transport, run: RunRecord, gpus: list[int] | None, event: Event, *,
               grace_s: float = KILL_GRACE_S, timeout_s: float = gpu.CLEANUP_TIMEOUT_S,
               sleep: Callable[[float], None] = time.sleep) -> str:
    """Kill what is left of a stopped run on its GPUs (members outliving their group leader), then wait
    until those GPUs are free. A host without nvidia-smi has nothing to free."""
    snap = gpu.snapshot(transport)
    if snap is None:
        return "no nvidia-smi on the host"
    selected = gpu.selected_gpus(snap, gpus)
    _kill_leftovers(transport, run, snap.processes(selected), event, grace_s)
    after = gpu.wait_until_free(transport, selected, timeout_s=timeout_s, sleep=sleep)
    names = indices_text(selected) or "none"
    event("gpu", f"GPUs {names} free after stop", gpu.snapshot_to_dict(after))
    return f"GPUs {names} free"


def _kill_leftovers(transport: Transport, run: RunRecord, procs: list[GpuProcess], event: Event, grace_s: float) -> None:
    """Members of the run's process group still on the GPUs after its group was stopped: one by one,
    each checked against its own start time, and only those provably the run's."""
    left = gpu.unique([p for p in procs if run.pid is not None and gpu.owns(run.pid, run.pid_start, p)])
    if left:
        outcome = gpu.kill_pids(transport, left, grace_s)
        event("gpu", f"killed {len(left)} leftover process(es) of run {run.id} ({outcome})", None)
