"""Stalled ≠ slow: a progress bar that has not advanced for `stall_factor` × its usual gap."""

from __future__ import annotations

from typing import Any

from . import agent
from .remote import Transport

ACTIONS = ("warn", "kill", "dump")


# The shortest usual gap between a bar's updates. A bar's rate is per item, but items often finish in
# bursts (a benchmark's concurrent requests complete in waves, a loader's shards in batches) and tqdm redraws
# at most every 0.1 s: a bar at 60 items/s may still go a second or two between updates. A gap this short is
# no sign of a stall whatever the rate says.
MIN_GAP_S = 1.0


def usual_gap(progress: dict[str, Any], started_at: float | None, now: float) -> float | None:
    """Seconds between updates: from the bar's rate, else the average so far; never under MIN_GAP_S."""
    rate = progress.get("rate_per_s")
    if rate:
        return max(1.0 / rate, MIN_GAP_S)
    done = progress.get("done") or 0
    if done > 0 and started_at:
        return max((now - started_at) / done, MIN_GAP_S)
    return None


def is_stalled(progress: dict[str, Any] | None, progress_at: float | None, started_at: float | None,
               now: float, factor: float, floor_s: float) -> float | None:
    """Seconds without progress when that counts as stalled, else None."""
    if not progress or progress_at is None:
        return None
    total = progress.get("total")
    if total is not None and progress.get("done", 0) >= total:
        return None  # a finished bar: the job is between phases, not stuck in one
    gap = usual_gap(progress, started_at, now)
    if gap is None:
        return None
    quiet = now - progress_at
    return quiet if quiet > max(factor * gap, floor_s) else None


def dump(transport: Transport, pgid: int, start: str = "") -> str:
    """py-spy stacks of every process of the job's group, taken by the host's agent (when the host has
    py-spy); with the job's start time, only of the processes proven the job's."""
    return str(agent.call(transport, "stacks", timeout=180, pid=int(pgid), start=start)["text"])
