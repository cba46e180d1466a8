"""Fan-out: `orch hosts --check` and `orch status --refresh` over 16 loopback sshd hosts, against a serial
`ssh` loop and `ansible all -m shell`; and `orch status` with 100 000 runs in the database.

    python bench/fanout.py [--ansible /path/to/ansible]

Writes the `## Fan-out` section of bench/RESULTS.md (other sections are kept).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from sshd import SSHFleet

HOSTS = 16
REPEATS = 3
RUNS = 100_000
ORCH = [sys.executable, "-m", "orchestrator"]


from results import write_section


def median_wall(fn: Callable[[], None], repeats: int = REPEATS) -> float:
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def run(argv: list[str], env: dict[str, str] | None = None, ok: tuple[int, ...] = (0,)) -> str:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode not in ok:
        raise SystemExit(f"{' '.join(argv[:6])}... exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def ansible_inventory(fleet: SSHFleet, path: Path, python: str) -> None:
    lines = ["[fleet]"]
    for i, s in enumerate(fleet.servers, 1):
        lines.append(f"test{i} ansible_host={s.address} ansible_port={s.port}")
    lines += [
        "", "[fleet:vars]", f"ansible_user={fleet.user}", f"ansible_ssh_private_key_file={fleet.client_key}",
        f"ansible_ssh_common_args='-o UserKnownHostsFile={fleet.known_hosts} -o StrictHostKeyChecking=yes'",
        f"ansible_python_interpreter={python}",
    ]
    path.write_text("\n".join(lines) + "\n")


def status_with_many_runs(tmp: Path) -> tuple[float, float]:
    """Wall time of `orch status` (and of `status --json`) over a database of RUNS runs."""
    from orchestrator.store import Store

    ws = tmp / "big"
    ws.mkdir()
    (ws / "hosts.toml").write_text("")
    store = Store(ws / "runs" / "orch.db")
    now = time.time()
    t0 = time.perf_counter()
    with store.tx():
        store.db["runs"].insert_all(
            ({"playbook": "command", "host": f"gpu{i % 64:02d}", "status": "running" if i % 10_000 == 0 else "succeeded",
              "phase": "finished", "spec": '{"cmd": "true"}', "created_at": now - RUNS + i, "log_offset": 0,
              "exit_code": 0} for i in range(RUNS)), batch_size=10_000)
        store.db["events"].insert_all(
            ({"run_id": 1 + i // 3, "ts": now, "kind": "status", "message": "succeeded"} for i in range(3 * RUNS)),
            batch_size=10_000)
        store.db["metrics"].insert_all(
            ({"run_id": 1 + i // 4, "name": ("gen_throughput", "accept_len")[i % 2], "value": float(i % 97),
              "ts": now, "step": i % 4} for i in range(4 * RUNS)), batch_size=10_000)
    print(f"  inserted {RUNS} runs, {3 * RUNS} events, {4 * RUNS} metrics in {time.perf_counter() - t0:.1f} s")
    store.close()
    env = {**os.environ, "ORCH_HOME": str(ws), "COLUMNS": "200"}
    table = median_wall(lambda: run(ORCH + ["status"], env))
    as_json = median_wall(lambda: run(ORCH + ["status", "--json"], env))
    return table, as_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ansible", default=shutil.which("ansible") or "/tmp/ansvenv/bin/ansible")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="orch-fanout-"))
    fleet = SSHFleet(HOSTS, root=tmp / "sshd")
    fleet.start()
    ws = tmp / "ws"
    ws.mkdir()
    (ws / "hosts.toml").write_text(fleet.hosts_toml())
    env = {**os.environ, "ORCH_HOME": str(ws), "COLUMNS": "200"}
    run_ids: list[str] = []
    try:
        print(f"{HOSTS} sshd hosts up; launching one long job per host for --refresh")
        procs = [subprocess.Popen(ORCH + ["run", "command", "--host", f"test{i}", "--detach", "--set", "cmd=sleep 900"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(1, HOSTS + 1)]
        for p in procs:
            out, err = p.communicate(timeout=300)
            if p.returncode != 0:
                raise SystemExit(f"launch failed: {err}")
            run_ids.append(out.strip())

        results: dict[str, float] = {}
        results["orch hosts --check"] = median_wall(lambda: run(ORCH + ["hosts", "--check", "--json"], env, ok=(0,)))
        results["orch status --refresh"] = median_wall(lambda: run(ORCH + ["status", "--refresh", "--json"], env))

        def serial_ssh() -> None:
            for s in fleet.servers:
                run(["ssh", "-i", str(fleet.client_key), "-o", f"UserKnownHostsFile={fleet.known_hosts}",
                     "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-p", str(s.port),
                     f"{fleet.user}@{s.address}", "uname -srm"])

        results["serial ssh loop"] = median_wall(serial_ssh)
        ansible_version = "not available"
        if Path(args.ansible).exists():
            inv = tmp / "inventory.ini"
            ansible_inventory(fleet, inv, str(Path(args.ansible).parent / "python"))
            aenv = {**os.environ, "ANSIBLE_HOST_KEY_CHECKING": "True", "ANSIBLE_LOCAL_TEMP": str(tmp / "ans"),
                    "ANSIBLE_REMOTE_TMP": str(tmp / "ans-remote"), "ANSIBLE_NOCOLOR": "1"}
            ansible_version = run([args.ansible, "--version"], aenv).splitlines()[0]
            results[f"ansible all -m shell -f {HOSTS}"] = median_wall(
                lambda: run([args.ansible, "all", "-i", str(inv), "-f", str(HOSTS), "-m", "shell",
                             "-a", "uname -srm"], aenv))
        for name, wall in results.items():
            print(f"  {name}: {wall:.2f} s")
    finally:
        for rid in run_ids:
            subprocess.run(ORCH + ["cancel", rid, "--grace", "1"], env=env, capture_output=True, timeout=120,
                           check=False)
        fleet.stop_all()

    print(f"orch status over {RUNS} runs")
    table, as_json = status_with_many_runs(tmp)
    print(f"  orch status: {table:.2f} s, --json: {as_json:.2f} s")
    empty = tmp / "empty"
    empty.mkdir()
    (empty / "hosts.toml").write_text("")
    baseline = median_wall(lambda: run(ORCH + ["status"], {**os.environ, "ORCH_HOME": str(empty)}))

    base = results["orch hosts --check"]
    lines = [
        "## Fan-out",
        "",
        (f"`python bench/fanout.py` — {HOSTS} real sshd hosts on loopback (tests/sshd.py), one command per host "
         f"(`uname -srm`, or one poll of a running job's log for `--refresh`), median wall time of {REPEATS} runs, "
         f"each including the CLI's start-up. {platform.python_implementation()} {platform.python_version()}, "
         f"{os.cpu_count()} CPUs; {ansible_version}."),
        "",
        "| command | median wall s | vs `orch hosts --check` |",
        "|---|---:|---:|",
    ]
    for name, wall in results.items():
        lines.append(f"| `{name}` | {wall:.2f} | {wall / base:.1f}x |")
    lines += [
        "",
        (f"`orch status` with {RUNS:,} runs ({3 * RUNS:,} events, {4 * RUNS:,} metric samples) in the database: "
         f"{table:.2f} s (table), {as_json:.2f} s (`--json`); with an empty database {baseline:.2f} s. "
         "It reads the newest 50 runs by rowid and each one's latest metrics through the "
         "(run_id, name, id) index, so the time does not grow with the table."),
        "",
    ]
    write_section("\n".join(lines))
    shutil.rmtree(tmp, ignore_errors=True)
    print("wrote the Fan-out section of bench/RESULTS.md")


if __name__ == "__main__":
    main()
