"""`orch status ID --json` on a run with many metric samples (a server's steady state: one sample per log
interval, thousands a day). Each status summarises every metric with its median's 95 % interval. The
interval walked out from the middle (orch) against the same interval found as the definition reads, every
candidate summing all n binomial counts again (what orch did before): the same answer, and how long each
takes. Writes the `## Status of a run with many samples` section of bench/RESULTS.md.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import write_section

from orchestrator.store import Store, noise
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status

SIZES = (100, 1_000, 1_500, 10_000, 100_000)
SLOW_UP_TO = 1_500  # the term-by-term sum past this takes minutes


def term_by_term(xs: list[float], level: float = noise.CI_LEVEL) -> tuple[float, float, float]:
    """The definition: every j from the outside in, each coverage a sum of n binomial counts."""
    xs, n = sorted(xs), len(xs)
    best = (xs[0], xs[-1], 1 - 2 * 0.5 ** n)
    for j in range(1, n // 2):
        coverage = sum(math.comb(n, k) for k in range(j + 1, n - j)) / 2 ** n
        if coverage < level:
            break
        best = (xs[j], xs[n - 1 - j], coverage)
    return best


def timed(fn, *args) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def status_wall(home: Path, run_id: int) -> float:
    env = {**os.environ, "ORCH_HOME": str(home)}
    times = []
    for _ in range(5):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "orchestrator", "status", str(run_id), "--json"], env=env,
                       check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        store = Store(home / "runs" / "orch.db")  # the workspace's database
        for n in SIZES:
            xs = [100 + 10 * math.sin(i) for i in range(n)]
            walk, got = timed(noise.median_ci, xs)
            slow, want = timed(term_by_term, xs) if n <= SLOW_UP_TO else (math.nan, got)
            assert got == want, (n, got, want)
            run_id = store.create_run("command", "local", {"cmd": "true"})
            for status in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING, Status.SUCCEEDED):  # ended: unwatched
                transition(store, run_id, status)
            store.add_metrics(run_id, [("gen_throughput", x, i) for i, x in enumerate(xs)], time.time())
            rows.append((n, walk, slow, status_wall(home, run_id)))
            print(rows[-1], flush=True)
    load = os.getloadavg()[0]
    lines = [
        "## Status of a run with many samples", "",
        "`python bench/status_samples.py` — the median's 95 % interval of a metric's n samples, as every `orch status`",
        "computes it for every metric of a run: walked out from the middle (orch) against every candidate interval",
        "summed term by term (orch before; past 1,500 samples it takes minutes), the same interval both ways; and",
        (f"`orch status ID --json` on such a run, median of 5. Load average {load:.1f} on "
         f"{os.cpu_count()} CPUs."), "",
        "| samples | interval, walked | interval, term by term | ratio | `orch status ID --json` |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, walk, slow, wall in rows:
        ratio = "-" if math.isnan(slow) else f"{slow / walk:,.0f}x"
        slow_s = "not run" if math.isnan(slow) else f"{slow * 1e3:,.1f} ms"
        lines.append(f"| {n:,} | {walk * 1e3:.2f} ms | {slow_s} | {ratio} | {wall:.2f} s |")
    write_section("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
