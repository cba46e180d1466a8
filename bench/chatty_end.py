"""How late the end of a chatty job is recorded, over real SSH: the lag from the job's exit (the time its
wrapper wrote) to its end in the record (the `succeeded` status event), by one host watcher in this process.

    python bench/chatty_end.py [--seconds 20] [--rate-mib 3] [--redraw-mib 200] [--repeat 3] [--tail-f]

Two jobs, each alone on one real sshd host on loopback:
  * lines: writes `--rate-mib` MiB/s for `--seconds` s, a mix of what a busy server prints (vLLM metric
    lines, per-request INFO lines, a tqdm bar redrawn between them), then exits 0;
  * redraw: writes one tqdm bar redrawn with `\\r` and no newline, `--redraw-mib` MiB as fast as it can,
    then exits 0.
With `--tail-f`, the same jobs followed by `ssh host tail -F log` into a pipe this process reads: the lag
from the exit to the last byte of the log reaching here (nothing parsed), what a person's terminal sees.
Writes the `## A chatty job's end` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
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
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.watch.hostwatch import HostWatcher

WRITER = r"""
import sys, time
kind, a, b = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
out = sys.stdout.buffer
def bar(k, n):
    return (b"\rProcessed prompts: %3d%%|#####     | %d/%d [00:%02d<00:%02d, 812.44it/s, est. speed input: 1234.5 toks/s]"
            % (100 * k // n, k, n, k % 60, (n - k) % 60))
if kind == "redraw":  # one line redrawn, never ended: `b` MiB
    total, n, k = int(b * (1 << 20)), 0, 0
    while n < total:
        block = b"".join(bar(k + j, 1 << 24) for j in range(1000))
        out.write(block)
        n += len(block)
        k += 1000
else:  # `a` MiB/s for `b` s, in 20 ms slices
    rate, began, sent, i = a * (1 << 20), time.monotonic(), 0, 0
    while time.monotonic() - began < b:
        due = rate * (time.monotonic() - began)
        parts = []
        while sent + sum(map(len, parts)) < due:
            i += 1
            if i % 50 == 0:
                parts.append(b"INFO 12-02 10:00:%02d [metrics.py:%d] Avg prompt throughput: %d.4 tokens/s, Avg generation"
                             b" throughput: %d.7 tokens/s, Running: %d reqs, Swapped: 0 reqs, Pending: %d reqs, GPU KV"
                             b" cache usage: %d.5%%, CPU KV cache usage: 0.0%%.\n" % (i % 60, i % 900, i % 5000, i % 3000,
                                                                                    i % 64, i % 9, i % 100))
            elif i % 7 == 0:
                parts.append(b"".join(bar(i + j, 1 << 20) for j in range(20)) + b"\n")
            else:
                parts.append(b"INFO:     127.0.0.1:%d - \"POST /v1/completions HTTP/1.1\" 200 OK request_id=cmpl-%032x\n"
                             % (40000 + i % 20000, i))
        block = b"".join(parts)
        out.write(block)
        out.flush()
        sent += len(block)
        time.sleep(0.02)
out.flush()
"""


def launch_job(host: Host, tmp: Path, kind: str, a: float, b: float) -> tuple[launch.RunPaths, int, str]:
    transport = SSHTransport(host)
    writer = tmp / "writer.py"
    writer.write_text(WRITER)
    paths = launch.RunPaths.for_run(host.workdir, int(time.time() * 1000) % 10**9)
    cmd = " ".join(shlex.quote(x) for x in (sys.executable, str(writer), kind, str(a), str(b)))
    job = HostExecutor(transport).launch(paths, launch.job_script(cmd, {}), f"bench-{paths.root}")
    transport.close()
    return paths, job.id, job.proof


def exit_time(paths: launch.RunPaths) -> float:
    return float(Path(paths.root, ".orch", "ended_at").read_text())


def watched(host: Host, fleet: SSHFleet, tmp: Path, kind: str, a: float, b: float) -> tuple[float, int]:
    """The lag (s) from the job's exit to its end recorded, and the log's size."""
    ws = Workspace(root=tmp, hosts_file=tmp / "hosts.toml")
    ws.runs_dir.mkdir(parents=True)
    ws.hosts_file.write_text(fleet.hosts_toml())
    store = Store(ws.db_path)
    paths, pid, start = launch_job(host, tmp, kind, a, b)
    # a server's run: its parser looks for its ready line (which the jobs never print)
    spec = {"cmd": "true", "poll_min": 0.5, "poll_max": 5, "ready_pattern": "Uvicorn running on"}
    run_id = store.create_run("command", "test1", spec)
    for status in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, status)
    store.update_run(run_id, remote_dir=paths.root)
    transition(store, run_id, Status.RUNNING, pid=pid, pid_start=start)
    watcher = HostWatcher(ws, "test1")
    thread = threading.Thread(target=watcher.serve)
    thread.start()
    while not store.get_run(run_id).status.terminal:
        time.sleep(0.05)
    run = store.get_run(run_id)
    recorded = next(e["ts"] for e in store.events(run_id) if e["kind"] == "status" and e["message"].startswith(
        run.status.value))
    watcher.stopping.set()
    thread.join()
    store.close()
    assert run.status is Status.SUCCEEDED, run.reason
    return recorded - exit_time(paths), run.log_offset


def tail_f(host: Host, fleet: SSHFleet, tmp: Path, kind: str, a: float, b: float) -> float:
    """The lag from the job's exit to the log's last byte read here through `ssh host tail -F`."""
    tmp.mkdir(parents=True)
    paths, _, _ = launch_job(host, tmp, kind, a, b)
    entry = fleet.host_entry(1)
    ssh = ["ssh", "-p", str(entry["port"]), "-i", entry["identity_file"], "-o", f"UserKnownHostsFile={entry['known_hosts']}",
           "-o", "BatchMode=yes", f"{entry['user']}@{entry['address']}",
           f"tail -c +1 -F {shlex.quote(str(Path(paths.root, 'log')))}"]
    proc = subprocess.Popen(ssh, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    got, last = 0, time.time()
    fd = proc.stdout.fileno()  # type: ignore[union-attr]
    os.set_blocking(fd, False)
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            chunk = None
        if chunk:
            got += len(chunk)
            last = time.time()
            continue
        log = Path(paths.root, "log")
        if Path(paths.root, ".orch", "ended_at").exists() and got >= log.stat().st_size:
            break
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    return last - exit_time(paths)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--rate-mib", type=float, default=3)
    ap.add_argument("--redraw-mib", type=float, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tail-f", action="store_true")
    ap.add_argument("--label", default="now", help="what this checkout is (its row in the table)")
    args = ap.parse_args()
    cases = {"lines": ("lines", args.rate_mib, args.seconds), "redraw": ("redraw", 0, args.redraw_mib)}
    rows: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp, SSHFleet(1, root=Path(tmp) / "sshd") as fleet:
        fleet.start()
        host = Host(name="test1", **fleet.host_entry(1))
        for r in range(args.repeat):
            for name, (kind, a, b) in cases.items():
                lag, size = watched(host, fleet, Path(tmp) / f"{name}{r}", kind, a, b)
                rows.setdefault(f"orch ({args.label}): {name}", []).append(lag)
                sizes[name] = size
                print(f"{name}: end recorded {lag:.2f} s after the exit ({size / (1 << 20):.0f} MiB)", flush=True)
                if args.tail_f:
                    lag = tail_f(host, fleet, Path(tmp) / f"t{name}{r}", kind, a, b)
                    rows.setdefault(f"ssh tail -F: {name}", []).append(lag)
                    print(f"{name}: tail -F had the last byte {lag:.2f} s after the exit", flush=True)
    print({k: f"median {statistics.median(v):.2f} max {max(v):.2f}" for k, v in rows.items()})
    load = os.getloadavg()[0]
    old = _old_rows()
    lines = [
        "## A chatty job's end (bench/chatty_end.py)",
        "",
        (f"`python bench/chatty_end.py --seconds {args.seconds:g} --rate-mib {args.rate_mib:g} --redraw-mib"
        f" {args.redraw_mib:g} --repeat {args.repeat}` — one real sshd on loopback, one host watcher in process;"
        f" lines: a job writing {args.rate_mib:g} MiB/s for {args.seconds:g} s (vLLM metric lines, request lines,"
        f" a tqdm bar redrawn between them; {sizes.get('lines', 0) / (1 << 20):.0f} MiB), then exit 0; redraw: one"
        f" bar redrawn with `\\r`, never a newline, {args.redraw_mib:g} MiB as fast as it can, then exit 0. Lag: from"
        " the exit (the time the job's wrapper wrote) to the end in the record (its status event); `ssh tail -F`:"
        f" to the log's last byte read here (nothing parsed). A server's run: its parser looks for a ready line."
         f" Load average {load:.1f} at the end, 2 shared cores."),
        "",
        "| who: job | median lag s | max lag s | runs |",
        "|---|---:|---:|---:|",
        *old,
        *(f"| {k} | {statistics.median(v):.2f} | {max(v):.2f} | {len(v)} |" for k, v in rows.items()),
        "",
        "Goal: the lines job's end within 5 s of its exit, the redraw job's within 10 s.",
    ]
    write_section("\n".join(lines))


def _old_rows() -> list[str]:
    """Rows of another checkout kept from the section as it is (a run with another --label)."""
    from results import RESULTS

    text = RESULTS.read_text() if RESULTS.exists() else ""
    if "## A chatty job's end" not in text:
        return []
    section = text.split("## A chatty job's end", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| orch (") and "(now)" not in line]


if __name__ == "__main__":
    main()
