"""A run watched while the controller's disk fills up and empties again (run by test_faults inside a mount
namespace of its own, its workspace on a small tmpfs mounted there): prints what happened, as JSON.

python diskfull_scenario.py WORKSPACE HOSTDIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import runflow
from orchestrator.config.hosts import Inventory
from orchestrator.config.workspace import Workspace
from orchestrator.runflow import registry
from orchestrator.runflow.watching import host_lock_path
from orchestrator.store import Store
from playbooks.command import CommandSpec


def wait_for(what: str, predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def holder(lock: Path) -> int | None:
    """The pid of the process holding the host's watcher lock (from /proc/locks), or None."""
    ino = lock.stat().st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[5].split(":")[-1] == str(ino):
            return int(parts[4])
    return None


def main(root: Path, hostdir: Path) -> None:
    (root / "hosts.toml").write_text(f'[hosts.local]\nworkdir = "{hostdir}"\n')
    ws = Workspace(root=root, hosts_file=root / "hosts.toml")
    store = Store(ws.db_path)
    gate = hostdir / "gate"
    cmd = (f"for i in $(seq 1 50); do echo sample $i; done; while [ ! -e {gate} ]; do sleep 0.05; done; "
           "for i in $(seq 51 200); do echo sample $i; done")
    spec = CommandSpec(cmd=cmd, poll_min=0.05, poll_max=0.2)
    run = runflow.start(ws, store, registry.playbook("command"), spec, Inventory.load(ws.hosts_file, root).get("local"))
    if run.lock is not None:
        run.lock.release()  # the host's watcher follows it, as after `orch run --detach`
    wait_for("the first 50 lines recorded", lambda: run.refresh().last_line == "sample 50")
    lock = host_lock_path(ws, "local")
    watcher = holder(lock)
    filler = root / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], stderr=subprocess.DEVNULL, check=False)
    gate.touch()  # the job prints the rest and exits while the disk is full
    wait_for("the job's exit", lambda: (Path(run.paths.root) / ".orch" / "exit_code").exists())
    # the watcher reads the rest and is refused: the exit cannot be recorded while the disk is full
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and holder(lock) == watcher:
        time.sleep(0.05)
    during = {"status": run.refresh().status.value, "watcher_alive": holder(lock) == watcher}
    os.unlink(filler)
    try:
        wait_for("the run's end recorded and its end steps done", lambda: run.refresh().status.terminal and len(
            run.record.end_steps) == len(runflow.END_STEPS) and not run.record.end_claims, timeout=30)
    except SystemExit as exc:
        during["after"] = str(exc)
    record = run.refresh()
    print(json.dumps({
        "during": during, "status": record.status.value, "last_line": record.last_line,
        "same_watcher": holder(lock) in (watcher, None), "end_steps": record.end_steps,
        "events": [[e["kind"], e["message"]] for e in store.events(run.run_id)],
    }))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
