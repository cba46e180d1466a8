"""A job for tests: prints a tqdm-style bar like a real one (\r redraws on one line), then ends as told."""

import argparse
import os
import sys
import time
from pathlib import Path


def bar(label: str, n: int, total: int, elapsed: float) -> str:
    pct = 100 * n / total
    filled = int(10 * n / total)
    rate = n / elapsed if elapsed > 0 else 0
    remaining = (total - n) / rate if rate else 0
    return (f"\r{label}: {pct:3.0f}%|{'█' * filled}{' ' * (10 - filled)}| {n}/{total} "
            f"[00:{int(elapsed):02d}<00:{int(remaining):02d}, {rate:5.2f}it/s]")


def pause_here(gates: dict[str, str], point: str) -> None:
    """Held at `point` until the test creates its file: the test, not the clock, paces the job. The job
    first creates FILE.reached, so a test knows it is there."""
    if point in gates:
        gate = Path(gates[point])
        Path(f"{gate}.reached").touch()
        while not gate.exists():
            time.sleep(0.02)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sleep", type=float, default=0.1)
    ap.add_argument("--exit", type=int, default=0)
    ap.add_argument("--crash", action="store_true", help="raise an exception after the bar")
    ap.add_argument("--label", default="Processing")
    ap.add_argument("--marker", help="touch this file once the bar is half way")
    ap.add_argument("--stall-at", type=int, help="hang at this step, alive but silent")
    ap.add_argument("--pause", action="append", default=[], metavar="AT:FILE",
                    help="after drawing step AT (a number, or `end`: before the last line), wait until FILE exists")
    args = ap.parse_args()
    gates = dict(p.split(":", 1) for p in args.pause)
    print(f"job starting pid={os.getpid()} HOME_SET={'HOME' in os.environ}", flush=True)
    t0 = time.time()
    for i in range(args.steps + 1):
        sys.stderr.write(bar(args.label, i, args.steps, time.time() - t0))
        sys.stderr.flush()
        if args.marker and i == args.steps // 2:
            open(args.marker, "w").close()
        if args.stall_at is not None and i == args.stall_at:
            time.sleep(3600)
        pause_here(gates, str(i))
        if i < args.steps:
            time.sleep(args.sleep)
    sys.stderr.write("\n")
    pause_here(gates, "end")
    if args.crash:
        raise RuntimeError("the job hit a wall at the end")
    print("job done", flush=True)
    sys.exit(args.exit)


if __name__ == "__main__":
    main()
