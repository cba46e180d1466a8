"""How fast `orch pull` copies a run dir over real SSH: the host connection's SFTP session (pipelined reads,
READ_AHEAD bytes asked for at a time) against the agent's `chunk` requests it used before (1 MiB a round
trip over the agent's channel) and against OpenSSH's `scp -r` of the same dir.

    python bench/pull.py [--mib 64] [--repeat 5]

The run dir holds `--mib` MiB: one big file of random bytes (most of it), a 4 MiB log and 64 small files.
Each way copies it from one sshd on loopback (tests/sshd.py) into a fresh folder, on a connection (and an
agent) already up, as `orch pull` finds them after its listing; the ways take turns, the median of
`--repeat` copies of each is kept, each checked byte for byte. Writes the `## Pull` section of bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import filecmp
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
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from results import write_section
from sshd import SSHFleet

from orchestrator.config.hosts import Host
from orchestrator.host import agent, ssh
from orchestrator.host.launch import RunPaths
from orchestrator.host.ssh import SSHTransport
from orchestrator.runflow import fetching


def make_run_dir(root: Path, mib: int) -> int:
    """The run dir: a big file, a log and 64 small files, `mib` MiB in all; its size in bytes."""
    (root / "outputs").mkdir(parents=True)
    for i in range(64):
        (root / "outputs" / f"shard-{i:02d}.json").write_bytes(os.urandom(16 << 10))
    line = b"[2026-12-02 10:00:00 TP0] step 1234/100000 loss=1.2345 lr=3.0e-04 throughput=1234.5 tok/s\n"
    log = (line * ((4 << 20) // len(line) + 1))[:4 << 20]
    (root / "log").write_bytes(log)
    big = (mib << 20) - len(log) - 64 * (16 << 10)
    with (root / "model.safetensors").open("wb") as f:
        for _ in range(big >> 20):
            f.write(os.urandom(1 << 20))
        f.write(os.urandom(big & ((1 << 20) - 1)))
    return mib << 20


def chunk_pull(transport: SSHTransport, root: str, to: Path) -> None:
    """How `orch pull` copied before: the agent's listing, then each file in `chunk` requests of 1 MiB."""
    listing = agent.call(transport, "files", timeout=120, dir=root, skip="pulled")["files"]
    for size, name in listing:
        target = to / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as f:
            offset = 0
            while offset < size:
                want = min(1 << 20, size - offset)
                reply = agent.call(transport, "chunk", timeout=300, path=f"{root}/{name}", offset=offset,
                                   length=want)
                data = agent.data_of(reply)
                f.write(data)
                offset += len(data)
                if len(data) < want:
                    break


def scp_pull(host: Host, root: str, to: Path) -> None:
    subprocess.run(["scp", "-q", "-r", "-P", str(host.port), "-i", str(host.identity_file),
                    "-o", f"UserKnownHostsFile={host.known_hosts}", "-o", "BatchMode=yes",
                    f"{host.user}@{host.address}:{root}", str(to)], check=True)


def same_tree(a: Path, b: Path) -> bool:
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    if files != sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file()):
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    return not mismatch and not errors


def timed(ways: list[tuple[str, Callable[[Path], None]]], source: Path, scratch: Path,
          repeat: int) -> list[tuple[str, float]]:
    """Median wall time of each way; the ways take turns, so a change in the machine's load falls on all."""
    walls: dict[str, list[float]] = {name: [] for name, _ in ways}
    for i in range(repeat):
        for name, copy in ways:
            to = scratch / f"copy-{i}"
            started = time.perf_counter()
            copy(to)
            walls[name].append(time.perf_counter() - started)
            copied = to / source.name if (to / source.name).is_dir() else to  # scp -r puts the dir inside
            if not same_tree(source, copied):
                raise SystemExit(f"{name}: the copy in {to} differs from {source}")
            shutil.rmtree(to)
    return [(name, statistics.median(walls[name])) for name, _ in ways]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, SSHFleet(1, root=Path(tmp) / "sshd") as fleet:
        fleet.start()
        host = Host(name="test1", **fleet.host_entry(1))
        source = Path(tmp) / "runs" / "1"
        size = make_run_dir(source, args.mib)
        transport = SSHTransport(host)
        run = SimpleNamespace(paths=RunPaths(str(source)), transport=transport, host=host, run_id=1)
        agent.call(transport, "ping")  # the connection and the agent up, as a pull finds them
        small = SSHTransport(host)  # its own session, which learns 32 KiB requests
        small_ctx = SimpleNamespace(paths=RunPaths(str(source)), transport=small, host=host, run_id=1)

        def in_small_pieces(to: Path) -> None:
            ssh.SFTP_PIECE, kept = 32 << 10, ssh.SFTP_PIECE
            try:
                fetching.pull(small_ctx, to, limit=size)  # type: ignore[arg-type]
            finally:
                ssh.SFTP_PIECE = kept

        load = os.getloadavg()[0]
        ways: list[tuple[str, Callable[[Path], None]]] = [
            ("pull over SFTP (now)", lambda to: fetching.pull(run, to, limit=size)),  # type: ignore[arg-type]
            ("pull over SFTP in paramiko's 32 KiB requests", in_small_pieces),
            ("agent chunk requests (before)", lambda to: chunk_pull(transport, str(source), to)),
            ("scp -r (OpenSSH)", lambda to: scp_pull(host, str(source), to)),
        ]
        rows = timed(ways, source, Path(tmp), args.repeat)
        transport.close()
        small.close()
    ssh_version = subprocess.run(["ssh", "-V"], capture_output=True, text=True, check=False).stderr.strip()
    lines = [
        "## Pull (bench/pull.py)", "",
        (f"`python bench/pull.py --mib {args.mib} --repeat {args.repeat}` — one sshd on loopback "
        f"(tests/sshd.py), "
        f"a run dir of {args.mib} MiB (one file of random bytes, a 4 MiB log, 64 files of 16 KiB), copied into "
        f"a fresh folder on a connection already up (the CLI's start-up left out: the same for every way); "
        f"median wall time of {args.repeat} copies taking turns, each checked byte for byte. "
        f"CPython {platform.python_version()}, {os.cpu_count()} CPUs, {ssh_version}; paramiko "
        f"{__import__('paramiko').__version__}, read-ahead {ssh.READ_AHEAD >> 20} MiB in requests of "
        f"{ssh.SFTP_PIECE >> 10} KiB; load average {load:.1f} at the start (the machine is shared)."), "",
        "| way | median wall s | MiB/s | vs SFTP |", "|---|---:|---:|---:|",
    ]
    ours = rows[0][1]
    for name, wall in rows:
        lines.append(f"| {name} | {wall:.2f} | {args.mib / wall:.0f} | {wall / ours:.1f}x |")
    lines += [
        "",
        ("Each SFTP read request is answered by sshd's sftp-server in C; paramiko's Python handles one message "
        "per request, so asking for what the server gives at once (255 KiB on OpenSSH, learnt from a session's "
        "first read) cuts its work per byte, and READ_AHEAD bytes asked for at a time keep the link busy while "
        "what waits in memory stays bounded (`orch logs --all` never holds a whole log). The agent's way took a "
        "JSON request, a reply and a copy through the agent's own Python for every MiB. scp is C at both ends, "
        "and its figure includes its own connection and login. The machine is shared: figures move with its "
        "load, the ratios less so."),
    ]
    section = "\n".join(lines) + "\n"
    print(section)
    write_section(section)


if __name__ == "__main__":
    main()
