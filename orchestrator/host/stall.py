"""Stalled ≠ slow: a progress bar that has not advanced for `stall_factor` × its usual gap."""

from __future__ import annotations

from typing import Any

from . import agent
from .remote import Transport

ACTIONS = ("warn", "kill", "dump")


def usual_gap(progress: dict[str, Any], started_at: float | None, now: float) -> float | None:
    """Seconds between updates: from the bar's rate, else the average so far."""
    rate = progress.get("rate_per_s")
    if rate:
        return 1.0 / rate
    done = progress.get("done") or 0
    if done > 0 and started_at:
        return (now - started_at) / done
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
