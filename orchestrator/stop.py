"""`orch stop`: end a run (a server, usually) and leave its GPUs free for the next one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import gpu
from .watch import stop

if TYPE_CHECKING:
    from .playbook import Playbook, RunContext

REASON = "stopped by user"


def stop_run(pb: Playbook, ctx: RunContext, grace_s: float = gpu.KILL_GRACE_S,
             sleep: Callable[[float], None] = time.sleep) -> str:
    """SIGTERM the run's process group (then SIGKILL), mark it cancelled, finish it, free its GPUs.

    Returns what happened, in words. The run is cancelled even when its GPUs then stay busy (that
    raises, naming what holds them).
    """
    outcome = cancel(pb, ctx, REASON, grace_s)
    return f"process group {outcome}; " + free_gpus(ctx, grace_s, sleep)


def cancel(pb: Playbook, ctx: RunContext, reason: str, grace_s: float) -> str:
    """Mark the run cancelled, stop its process group, then finish it as any ended run."""
    from .playbook import after_end

    outcome = stop(ctx.store, ctx.run_id, ctx.transport, reason, grace_s)
    after_end(pb, ctx)
    return outcome


def free_gpus(ctx: RunContext, grace_s: float, sleep: Callable[[float], None] = time.sleep) -> str:
    """Kill what is left of the run on its GPUs (members outliving their group leader), then wait until
    those GPUs are free. A host without nvidia-smi has nothing to free."""
    snap = gpu.snapshot(ctx.transport)
    if snap is None:
        return "no nvidia-smi on the host"
    run = ctx.store.get_run(ctx.run_id)
    selected = gpu.selected_gpus(snap, ctx.spec.gpus)
    # The run's process group, as gpu.attribute tells it (which looks at active runs only: this one ended).
    left = [p for p in snap.processes(selected) if run["pid"] and p.pgid == int(run["pid"])
            and (p.group_start is None or p.group_start == run["pid_start"])]
    if left:
        outcome = gpu.kill_pids(ctx.transport, list({p.pid: p for p in left}.values()), grace_s)
        ctx.event("gpu", f"killed {len(left)} leftover process(es) of the run ({outcome})")
    after = gpu.wait_until_free(
        ctx.transport, selected,
        memory_free_mib=int(getattr(ctx.spec, "memory_free_mib", None) or gpu.MEMORY_FREE_MIB),
        timeout_s=getattr(ctx.spec, "cleanup_timeout_s", None) or gpu.CLEANUP_TIMEOUT_S,
        sleep=sleep,
    )
    names = ",".join(str(i) for i in selected) or "none"
    ctx.event("gpu", f"GPUs {names} free after stop", gpu.snapshot_to_dict(after))
    return f"GPUs {names} free"
