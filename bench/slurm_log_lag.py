"""How soon a line a batch job prints is in orch's record, on the test cluster (a real one-node Slurm,
tests/slurmcluster.py), with an hour between polls: the login node's agent follows the job's log on the
shared filesystem and pushes it, so the lag is the push's, not the polls'. tests/test_slurm.py checks that
the line comes without a poll; this measures how soon.

    python bench/slurm_log_lag.py [--jobs 5]

Each job waits, running, until it is let go, then prints `orch-metric printed_at=<its clock>`; the lag is
the time from that clock to the moment `orch status` first shows the metric (asked every 0.1 s, so up to
0.1 s and one `orch status` of it is the asking). Writes its own section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from orchtest import Orch
from results import write_section
from slurmcluster import SlurmCluster, missing, running

SECTION = "## Slurm log lag (bench/slurm_log_lag.py)"


def one_lag(orch: Orch, shared: Path, i: int) -> float:
    go = shared / f"go-{i}"
    cmd = (f"cmd=until [ -e {go} ]; do sleep 0.05; done; echo \"orch-metric printed_at=$(date +%s.%N)\"; "
           "sleep 60")
    res = orch("run", "command", "--host", "cluster", "--set", cmd, "--set", "poll_min=3600", "--set",
               "poll_max=3600", "--detach", check=0)
    run_id = int(res.stdout)
    orch.wait_for(run_id, lambda d: d["status"] == "running", timeout=120)
    go.touch()
    doc = orch.wait_for(run_id, lambda d: "printed_at" in d["metrics"], timeout=120)
    lag = time.time() - doc["metrics"]["printed_at"]
    orch("cancel", str(run_id), "--grace", "1", check=0)
    return lag


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=5)
    args = ap.parse_args()
    why = missing()
    if why:
        sys.exit(f"no cluster here: {why}")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        shared = tmp / "shared"
        shared.mkdir()
        with running(SlurmCluster(tmp / "slurm", gpus=0)):
            orch = Orch(tmp / "ws", f'[hosts.cluster]\nscheduler = "slurm"\ngpus = 0\nworkdir = "{shared}"\n'
                                    f'python = "{sys.executable}"\n')
            lags = [one_lag(orch, shared, i) for i in range(args.jobs)]
    load = os.getloadavg()[0]
    lines = [SECTION, "",
             (f"A line a running batch job prints, until `orch status` shows it, polls an hour apart: {args.jobs} "
              f"jobs one after another on this machine ({os.cpu_count()} cores, load average {load:.1f}: shared "
              "with other jobs)."), "",
             "| median s | max s |", "|---:|---:|",
             f"| {statistics.median(lags):.2f} | {max(lags):.2f} |"]
    write_section("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
