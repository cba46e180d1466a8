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

from .noise import noise

WARMUP_FRACTION = 0.1  # the share of a metric's first samples left out of its mean and p50
# Serving rates whose zero samples are the engine's idle lines: vLLM logs one stats line at 0 after every
# burst of requests, so the last sample of any idle server is 0. Their headline is the steady state of the
# samples taken at work.
IDLE_ZERO = frozenset({"gen_throughput"})


def steady(values: Sequence[float]) -> Sequence[float]:
    """The samples of the steady state: all but the first WARMUP_FRACTION of them (rounded down)."""
    return values[math.floor(len(values) * WARMUP_FRACTION):]


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """last (the latest sample, a NaN too), mean and p50 over the steady state's finite samples (NaN when it
    has none), how many samples each counts, and their spread (a benchmark's repeats, a server's steady state)."""
    kept = [v for v in steady(values) if math.isfinite(v)]
    spread = noise(kept)
    return {"last": values[-1], "mean": statistics.fmean(kept) if kept else math.nan,
            "p50": statistics.median(kept) if kept else math.nan, "samples": len(values), "steady_samples": len(kept),
            **{k: spread.get(k) for k in ("min", "max", "spread", "ci_low", "ci_high", "ci_level")}}


def headline(name: str, values: Sequence[float]) -> float:
    """A metric's value as a run's headline shows it: the latest sample; for a serving rate (IDLE_ZERO), the
    mean over the steady state of its samples at work (the latest when it never worked)."""
    if name in IDLE_ZERO:
        busy = [v for v in values if v > 0]
        if busy:
            return statistics.fmean(steady(busy))
    return values[-1]


def judged(name: str, values: Sequence[float]) -> list[float]:
    """The samples a verdict weighs (store/noise.py): the steady state (a benchmark's repeats: all of them
    under ten); of a serving rate, its samples at work (the idle zeros between bursts measure nothing)."""
    if name in IDLE_ZERO:
        values = [v for v in values if v > 0]
    return [v for v in steady(values) if math.isfinite(v)]


def summaries(samples: Iterable[tuple[str, float]]) -> dict[str, dict[str, Any]]:
    """Per metric name (sorted), the summary of its samples given as (name, value) in recorded order."""
    series: dict[str, list[float]] = {}
    for name, value in samples:
        series.setdefault(name, []).append(float(value))
    return {name: summarize(series[name]) for name in sorted(series)}


def line(name: str, s: Mapping[str, Any]) -> str:
    """One metric's summary as people read it: `name = last  (mean …, p50 … of n samples)`."""
    return f"{name} = {s['last']:g}  (mean {s['mean']:.4g}, p50 {s['p50']:.4g} of {s['steady_samples']} samples)"

