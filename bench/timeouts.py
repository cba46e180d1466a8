"""What a silent party costs: the bounds the tests check only functionally (it returned, and said so),
measured here as wall time against the bound asked for.

- `orch hosts --check` and `orch gpus --all` with one of two loopback sshd hosts frozen (SIGSTOP: the
  kernel accepts the connection, nothing answers), `--timeout T`;
- `orch run command` whose notify URL accepts the connection and never answers, `notify_timeout_s=1`:
  the command's wall time, and the delay from the run's end to the notification's warning;
- `notify.send` to a receiver trickling its headers a byte at a time, `total_s=1.5`: time to give up.

Medians of R tries; the interpreter's start-up is measured alone for reference (`orch --help`).
Writes its own section of bench/RESULTS.md. Usage: python bench/timeouts.py [--tries 3] [--timeout 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from results import write_section
from sshd import SSHFleet

SECTION = "## Timeouts: a silent host or receiver"
ORCH = [sys.executable, "-m", "orchestrator"]


def wall(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, capture_output=True, timeout=300, check=False)
    return time.perf_counter() - t0


def median(fn, tries: int) -> float:
    return statistics.median(fn() for _ in range(tries))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args()
    t = f"{args.timeout:g}"
    rows: list[tuple[str, str, float]] = []
    with tempfile.TemporaryDirectory() as tmp, SSHFleet(2, root=Path(tmp) / "sshd") as fleet:
        ws = Path(tmp) / "ws"
        ws.mkdir()
        (ws / "hosts.toml").write_text(fleet.hosts_toml(**{f"test{i}": {"workdir": f"{tmp}/r{i}"} for i in (1, 2)}))
        env = {**os.environ, "ORCH_HOME": str(ws), "HOME": tmp}
        rows.append(("`orch --help` (start-up alone)", "-", median(lambda: wall([*ORCH, "--help"], env), args.tries)))
        frozen = fleet.server(2)._proc.pid
        os.kill(frozen, signal.SIGSTOP)
        try:
            for name, argv in (("`orch hosts --check`", ["hosts", "--check", "--json"]),
                               ("`orch gpus --all`", ["gpus", "--all", "--json"])):
                rows.append((f"{name}, one host frozen", f"{t} s",
                             median(lambda: wall([*ORCH, *argv, "--timeout", t], env), args.tries)))  # noqa: B023
        finally:
            os.kill(frozen, signal.SIGCONT)

        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/hook"
        delays: list[float] = []

        def notify_run() -> float:
            took = wall([*ORCH, "run", "command", "--set", "cmd=true", "--set", f'notify=["{url}"]',
                         "--set", "notify_timeout_s=1", "--set", "poll_min=0.05"], env)
            docs = json.loads(subprocess.run([*ORCH, "status", "--json"], env=env, capture_output=True,
                                             check=True).stdout)
            doc = json.loads(subprocess.run([*ORCH, "status", "--json", str(docs[0]["id"])], env=env,
                                            capture_output=True, check=True).stdout)
            warning = next(e["ts"] for e in doc["events"] if e["kind"] == "warning")
            delays.append(warning - doc["ended_at"])
            return took

        rows.append(("`orch run` with a silent notify URL", "1 s", median(notify_run, args.tries)))
        rows.append(("  its end to the notification's warning", "1 s", statistics.median(delays)))
        silent.close()

    from orchestrator.runflow import notify

    trickler = socket.socket()
    trickler.bind(("127.0.0.1", 0))
    trickler.listen(8)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            try:
                conn, _ = trickler.accept()
            except OSError:
                return
            def feed(c: socket.socket = conn) -> None:
                try:
                    c.recv(65536)
                    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000:
                        if stop.is_set():
                            return
                        c.sendall(bytes([byte]))
                        time.sleep(0.2)
                except OSError:
                    pass
            threading.Thread(target=feed, daemon=True).start()

    threading.Thread(target=trickle, daemon=True).start()
    trickle_url = f"http://127.0.0.1:{trickler.getsockname()[1]}/hook"

    def give_up() -> float:
        t0 = time.perf_counter()
        notify.send([trickle_url], {"run_id": 1}, lambda u, m: None, total_s=1.5).join(60)
        return time.perf_counter() - t0

    rows.append(("`notify.send`, a receiver trickling its headers", "1.5 s", median(give_up, args.tries)))
    stop.set()
    trickler.close()

    load = os.getloadavg()[0]
    table = "\n".join(f"| {what} | {bound} | {took:.2f} |" for what, bound, took in rows)
    write_section(f"""{SECTION}

`python bench/timeouts.py` ({os.cpu_count()} cores, load average {load:.1f} at the end; medians of {args.tries}).
The tests check these only as "it returned, and said so"; the wall times are here.

| what | bound asked | wall (s) |
|---|---|---|
{table}
""")
    print(table)


if __name__ == "__main__":
    main()
