"""Metric summaries: a metric's last value, and its mean and median (p50) over the steady state.

The steady state is one rule for every caller (`orch status ID`, `orch compare`, the sweep tables,
`orch inspect-log`): a metric's samples in the order they were recorded, less the first 10 % of them
(rounded down: under 10 samples, none is dropped) — warm-up (the first decode batches, a cold cache)
weighs on the mean and median of no run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

WARMUP_FRACTION = 0.1  # the share of a metric's first samples left out of its mean and p50


def steady(values: Sequence[float]) -> Sequence[float]:
    """The samples of the steady state: all but the first WARMUP_FRACTION of them (rounded down)."""
    return values[math.floor(len(values) * WARMUP_FRACTION):]


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """last (the latest sample), mean and p50 over the steady state, and how many samples each counts."""
    kept = steady(values)
    return {"last": values[-1], "mean": statistics.fmean(kept), "p50": statistics.median(kept),
            "samples": len(values), "steady_samples": len(kept)}


def summaries(samples: Iterable[tuple[str, float]]) -> dict[str, dict[str, Any]]:
    """Per metric name (sorted), the summary of its samples given as (name, value) in recorded order."""
    series: dict[str, list[float]] = {}
    for name, value in samples:
        if math.isfinite(value):
            series.setdefault(name, []).append(float(value))
    return {name: summarize(series[name]) for name in sorted(series)}


def line(name: str, s: Mapping[str, Any]) -> str:
    """One metric's summary as people read it: `name = last  (mean …, p50 … of n samples)`."""
    return f"{name} = {s['last']:g}  (mean {s['mean']:.4g}, p50 {s['p50']:.4g} of {s['steady_samples']} samples)"


def short(s: Mapping[str, Any] | None) -> str:
    """A summary in a table cell: `last (p50 …)`."""
    if not s:
        return "-"
    return f"{s['last']:g} (p50 {s['p50']:.4g})"
