"""Stalled ≠ slow: a progress bar that has not advanced for `stall_factor` × its usual gap."""

from __future__ import annotations

from typing import Any

from .launch import group_pids_command
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


def dump_command(pgid: int) -> str:
    """py-spy stacks of every process of the job's group, when the host has py-spy."""
    return (
        "command -v py-spy >/dev/null 2>&1 || { echo 'py-spy is not installed on this host'; exit 0; }\n"
        f"for p in $({group_pids_command(pgid)}); do echo \"== pid $p\"; py-spy dump --pid \"$p\" 2>&1; done\n"
    )


def dump(transport: Transport, pgid: int) -> str:
    return transport.run(dump_command(pgid), check=False, timeout=120).stdout
