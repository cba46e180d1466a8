"""The test suite's wall time on a fresh clone: `make test-fast` and `make test` as the Makefile runs them,
in a clone of this checkout's HEAD (no .pyc, no pytest cache), with this checkout's virtual environment;
optionally beside N CPU hogs (`yes > /dev/null`), as on a loaded machine.

    python bench/suite.py [--hogs N]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import write_section

ROOT = Path(__file__).resolve().parent.parent
# the Makefile's two test targets, as commands (make itself would rebuild the environment for a new clone)
TIERS = {
    "make test-fast": ["-m", "pytest", "-q", "tests/fast"],
    "make test": ["-m", "pytest", "-q", "-n", "2", "--dist", "loadfile"],
}


def run_tier(clone: Path, args: list[str]) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": str(clone)}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=clone, env=env, capture_output=True, text=True,
                          check=False)  # a failing suite is a figure too
    wall = time.monotonic() - started
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-300:]
    for line in proc.stdout.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            print(line, flush=True)
    return wall, re.sub(r"=+", "", summary).strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hogs", type=int, default=0, help="CPU hogs beside the suite")
    args = ap.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    hogs = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.hogs)]
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            clone = Path(tmp) / "orch"
            subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
            for name, tier in TIERS.items():
                wall, summary = run_tier(clone, tier)
                load = os.getloadavg()[0]
                rows.append((name, wall, load, summary))
                print(f"{name}: {wall:.0f} s, load {load:.1f}: {summary}", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    lines = [
        "## Test suite (bench/suite.py)" if not args.hogs else f"## Test suite beside {args.hogs} CPU hogs (bench/suite.py)",
        "",
        f"`python bench/suite.py --hogs {args.hogs}` — a fresh clone of {head} (no .pyc, no pytest cache), this "
        f"checkout's virtual environment; {os.cpu_count()} CPUs"
        + (f", {args.hogs} CPU hogs (`yes > /dev/null`) beside it" if args.hogs else "") + ".",
        "",
        "| tier | wall s | load average at its end | pytest's summary |",
        "|---|---:|---:|---|",
        *[f"| `{name}` | {wall:.0f} | {load:.1f} | {summary} |" for name, wall, load, summary in rows],
    ]
    write_section("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
