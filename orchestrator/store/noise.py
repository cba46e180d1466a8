"""A metric's noise, measured from its own samples, and a difference between two runs judged against it.

The samples of a metric are a benchmark's repeats (one per repeat) or a server's steady state. Their
spread is summarised by the median, the min and max, and a 95 % confidence interval of the median taken
from the order statistics (distribution-free: no normal law assumed, nothing random). Two runs differ
only when those intervals do not overlap; with five repeats each the interval is the samples' whole range,
so a difference is called only when every repeat of one run beats every repeat of the other (two runs of
the same thing do that by chance 2 times in 252).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, Literal

CI_LEVEL = 0.95
MIN_SAMPLES = 3  # fewer samples a run than this: its spread is unknown, a difference "incomparable"
Verdict = Literal["better", "worse", "within_noise", "incomparable"]


def median_ci(values: Sequence[float], level: float = CI_LEVEL) -> tuple[float, float, float]:
    """The narrowest interval of order statistics [x_(j), x_(n-1-j)] that holds the median with at least
    `level` probability, and its coverage; with too few samples for `level`, the whole range (and the
    coverage it has)."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no samples")
    whole = (xs[0], xs[-1], 1 - 2 * 0.5 ** n if n > 1 else 0.0)
    # The coverage of [x_(j), x_(n-1-j)] (0-based) is P(j < B <= n-1-j) for B ~ Binomial(n, 1/2); it grows as
    # j falls. Walked out from the middle, the interval wanted is a few sqrt(n) steps away, each step one exact
    # binomial count: a run's thousands of samples are summarised at every `orch status`.
    j = n // 2 - 1
    if j < 1:
        return whole
    total = 1 << n
    inside = sum(math.comb(n, k) for k in range(j + 1, n - j))  # counts of B in (j, n-1-j]
    count = math.comb(n, j)  # of B = j, the next one in (with B = n-j) as j falls
    while inside / total < level:
        if j == 1:
            return whole
        inside += 2 * count
        count = count * j // (n - j + 1)
        j -= 1
    return xs[j], xs[n - 1 - j], inside / total


def noise(values: Sequence[float]) -> dict[str, Any]:
    """The spread of a metric's samples: n, median, min, max, spread (max - min over the median), mean,
    standard deviation and the median's confidence interval (ci_low, ci_high, ci_level)."""
    xs = [float(v) for v in values if math.isfinite(v)]
    if not xs:
        return {"n": 0}
    med = statistics.median(xs)
    low, high, coverage = median_ci(xs)
    return {"n": len(xs), "median": med, "min": min(xs), "max": max(xs),
            "spread": (max(xs) - min(xs)) / abs(med) if med else None,
            "mean": statistics.fmean(xs), "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "ci_low": low, "ci_high": high, "ci_level": round(coverage, 4)}


def verdict(a: Sequence[float], b: Sequence[float], direction: Literal["higher", "lower"] | None
            ) -> tuple[Verdict, str]:
    """B against A: better or worse when the medians' confidence intervals do not overlap (in the metric's
    direction), within_noise when they do; incomparable (with why) with too few samples or no direction."""
    na, nb = noise(a), noise(b)
    if na["n"] < MIN_SAMPLES or nb["n"] < MIN_SAMPLES:
        return "incomparable", f"too few samples ({na['n']} and {nb['n']}; {MIN_SAMPLES} each needed)"
    if nb["ci_low"] > na["ci_high"]:
        up = True
    elif nb["ci_high"] < na["ci_low"]:
        up = False
    else:
        return "within_noise", "the medians' confidence intervals overlap"
    if direction is None:
        return "incomparable", "a count or a setting: it changed, but neither way is better"
    change = f"median {na['median']:.4g} -> {nb['median']:.4g}"
    return ("better" if up == (direction == "higher") else "worse"), f"{change}, beyond the spread of both"
