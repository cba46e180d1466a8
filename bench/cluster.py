"""32 concurrent short jobs on the test cluster (a real one-node Slurm, tests/slurmcluster.py): watched
by orch (one watcher thread per run, as a sweep or several `orch watch` in one process would), against
submitting and polling the same jobs by hand (`sbatch` + a `squeue` loop, per job or one for all).

    python bench/cluster.py [--jobs 32] [--sleep 4]

Measures scheduler calls (squeue + sacct) per poll round and the wall time from the last submission
until every end is seen. Writes the `## Cluster` section of bench/RESULTS.md (other sections kept).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from slurmcluster import SlurmCluster

from orchestrator import runflow
from orchestrator.config import spec as specmod
from orchestrator.config.hosts import Inventory
from orchestrator.config.workspace import Workspace
from orchestrator.host import slurm
from orchestrator.runflow import registry
from orchestrator.store import Store
from orchestrator.watch import follow

ENDED = set(slurm.ENDED)


from results import write_section


def by_orch(tmp: Path, jobs: int, sleep_s: float) -> dict[str, float]:
    ws_root = tmp / "ws"
    ws_root.mkdir()
    (ws_root / "hosts.toml").write_text(
        f'[hosts.cluster]\nscheduler = "slurm"\ngpus = 0\nworkdir = "{tmp}/shared"\npoll_min = 1\npoll_max = 5\n')
    ws = Workspace(ws_root, ws_root / "hosts.toml")
    store = Store(ws.db_path)
    host = Inventory.load(ws.hosts_file, ws.root).get("cluster")
    pb = registry.playbook("command")
    spec = specmod.build(pb.Spec, {"cmd": f"sleep {sleep_s}", "gpus": []})
    polls = [0]
    real_poll = slurm.SlurmExecutor.poll

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        polls[0] += 1
        return real_poll(self, *args, **kwargs)

    slurm.SlurmExecutor.poll = counted  # type: ignore[method-assign]
    runs = [runflow.start(ws, store, pb, spec, host) for _ in range(jobs)]
    queue = slurm.queue_for(runs[0].transport)
    calls0, t0 = queue.calls, time.perf_counter()

    def watch(run_id: int) -> None:
        own = Store(ws.db_path)
        try:
            follow.watch(runflow.open_run(ws, own, run_id, {host.name: host}))
        finally:
            own.close()

    threads = [threading.Thread(target=watch, args=(c.run_id,)) for c in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    statuses = {store.get_run(c.run_id).status.value for c in runs}
    assert statuses == {"succeeded"}, statuses
    calls = queue.calls - calls0
    rounds = polls[0] / jobs
    return {"wall": wall, "calls": calls, "rounds": rounds, "per_round": calls / rounds}


def by_hand(cluster: SlurmCluster, jobs: int, sleep_s: float, per_job: bool) -> dict[str, float]:
    ids = [cluster.client("sbatch", "--parsable", "-o", "/dev/null", "--wrap", f"sleep {sleep_s}",
                          check=True).stdout.strip() for _ in range(jobs)]
    t0, calls, rounds = time.perf_counter(), 0, 0
    left = set(ids)
    while left:
        rounds += 1
        if per_job:  # the habit: `squeue -j ID` for each job
            for i in sorted(left):
                calls += 1
                state = cluster.client("squeue", "-h", "-t", "all", "-j", i, "-o", "%T").stdout.strip()
                if state.split(" ")[0] in ENDED:
                    left.discard(i)
        else:  # one squeue for all of them
            calls += 1
            out = cluster.client("squeue", "-h", "-t", "all", "-j", ",".join(sorted(left)), "-o", "%i %T").stdout
            left -= {line.split()[0] for line in out.splitlines() if line.split()[1] in ENDED}
        if left:
            time.sleep(1.0)
    wall = time.perf_counter() - t0
    return {"wall": wall, "calls": calls, "rounds": rounds, "per_round": calls / rounds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--sleep", type=float, default=4.0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="orch-cluster-"))
    cluster = SlurmCluster(tmp / "slurm", gpus=0, cpus=args.jobs).start()
    os.environ.update(cluster.env)
    try:
        rows = [("orch (one watcher per run)", by_orch(tmp, args.jobs, args.sleep))]
        cluster.cancel_all()
        rows.append(("sbatch + `squeue -j ID` per job, every 1 s", by_hand(cluster, args.jobs, args.sleep, True)))
        rows.append(("sbatch + one `squeue -j ID,...` for all, every 1 s",
                     by_hand(cluster, args.jobs, args.sleep, False)))
    finally:
        cluster.stop()
    version = subprocess.run(["sinfo", "--version"], capture_output=True, text=True,
                             check=True).stdout.strip()
    lines = [
        "## Cluster",
        "",
        (f"`python bench/cluster.py` — {args.jobs} concurrent jobs (`sleep {args.sleep:g}`) on a real one-node "
         f"cluster ({version}, {args.jobs} CPUs declared, tests/slurmcluster.py) on a {os.cpu_count()}-CPU machine, "
         f"CPython {platform.python_version()}. orch: `runflow.start` of each run, then one watcher thread per run "
         "(host poll 1 s → 5 s, so the queue is asked at most once a second); a poll round is one poll of every "
         "run; calls are squeue + sacct commands. Wall: from the last submission until every end is seen."),
        "",
        "| watcher | scheduler calls | poll rounds | calls per round | wall s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {r['calls']:.0f} | {r['rounds']:.1f} | {r['per_round']:.2f} | {r['wall']:.1f} |")
    lines.append("")
    write_section("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
