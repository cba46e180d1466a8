"""A made-up response surface for searching sweeps: a job whose metrics are a known function of its
environment (X, Y, KIND), printed as orch-metric samples over its run (PACE seconds apart), that crashes
out of memory in one region. `python surface_job.py --best` prints the true best under the latency bound, found by brute force."""

from __future__ import annotations

import math
import os
import sys
import time

SAMPLES = 8
KIND_BONUS = {"a": 0.0, "b": 8.0, "c": -4.0}
LATENCY_MAX = 300.0  # the bound the tests' [constraints] put on p99_latency_ms


def throughput(x: float, y: int, kind: str) -> float:
    """Peaks at X = 7 and Y = 16: near both the crashing region and the latency bound."""
    return 100.0 - 0.1 * (x - 7.0) ** 2 - 0.5 * (math.log2(y) - 4.0) ** 2 + KIND_BONUS[kind]


def latency(x: float, y: int) -> float:
    return 14.0 * y + 12.0 * x


def crashes(x: float, y: int) -> bool:
    """Out of memory where X and Y are both high: a sixth of the space, next to the peak."""
    return x / 10 + math.log2(y) / 6 > 1.4


def true_best() -> tuple[float, tuple[float, int, str]]:
    """The best throughput where the job neither crashes nor breaks the latency bound (X in steps of 0.01)."""
    found = (-math.inf, (0.0, 0, ""))
    for i in range(1001):
        x = i / 100
        for y in range(1, 65):
            for kind in KIND_BONUS:
                if crashes(x, y) or latency(x, y) > LATENCY_MAX:
                    continue
                v = throughput(x, y, kind)
                if v > found[0]:
                    found = (v, (x, y, kind))
    return found


def main() -> None:
    if sys.argv[1:] == ["--best"]:
        print(true_best())
        return
    x, y, kind = float(os.environ["X"]), int(os.environ["Y"]), os.environ["KIND"]
    pace = float(os.environ.get("PACE", "0.2"))
    if crashes(x, y):
        time.sleep(pace)
        print("Traceback (most recent call last):\n  File \"serve.py\", line 1, in <module>", flush=True)
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        sys.exit(1)
    value = throughput(x, y, kind)
    gate = os.environ.get("GATE")  # a test's: the job holds before its last sample until this file exists
    for step in range(SAMPLES):
        while gate and step == SAMPLES - 1 and not os.path.exists(gate):
            time.sleep(0.02)
        # the samples climb to the final value: a loser shows as one from its first samples
        print(f"orch-metric throughput={value * (0.9 + 0.1 * step / (SAMPLES - 1)):.4f}", flush=True)
        time.sleep(pace)
    print(f"orch-metric p99_latency_ms={latency(x, y):.3f}", flush=True)


if __name__ == "__main__":
    main()
