"""How fast `orch pull` copies a run dir over real SSH: the host connection's SFTP session (pipelined reads,
READ_AHEAD bytes asked for at a time) against the agent's `chunk` requests it used before (1 MiB a round
trip over the agent's channel) and against OpenSSH's `scp -r` of the same dir.

    python bench/pull.py [--mib 64] [--repeat 3]

The run dir holds `--mib` MiB: one big file of random bytes (most of it), a 4 MiB log and 64 small files.
Each way copies it from one sshd on loopback (tests/sshd.py) into a fresh folder, on a connection (and an
agent) already up, as `orch pull` finds them after its listing; the median of `--repeat` copies is kept,
each checked byte for byte. Writes the `## Pull` section of bench/RESULTS.md.
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

from sshd import SSHFleet  # noqa: E402

from orchestrator import agent, ssh  # noqa: E402
from orchestrator.hosts import Host  # noqa: E402
from orchestrator.launch import RunPaths  # noqa: E402
from orchestrator.runflow import fetching  # noqa: E402
from orchestrator.ssh import SSHTransport  # noqa: E402
from results import write_section  # noqa: E402


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
                reply = agent.call(transport, "chunk", timeout=300, path=f"{root}/{name}", offset=offset, length=want)
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


def timed(copy: Callable[[Path], None], source: Path, scratch: Path, repeat: int) -> float:
    walls = []
    for i in range(repeat):
        to = scratch / f"copy-{i}"
        started = time.perf_counter()
        copy(to)
        walls.append(time.perf_counter() - started)
        copied = to / source.name if (to / source.name).is_dir() else to  # scp -r puts the dir inside
        if not same_tree(source, copied):
            raise SystemExit(f"the copy in {to} differs from {source}")
        shutil.rmtree(to)
    return statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, SSHFleet(1, root=Path(tmp) / "sshd") as fleet:
        fleet.start()
        host = Host(name="test1", **fleet.host_entry(1))
        source = Path(tmp) / "runs" / "1"
        size = make_run_dir(source, args.mib)
        transport = SSHTransport(host)
        ctx = SimpleNamespace(paths=RunPaths(str(source)), transport=transport, host=host, run_id=1)
        agent.call(transport, "ping")  # the connection and the agent up, as a pull finds them
        ways: list[tuple[str, Callable[[Path], None]]] = [
            ("orch pull (SFTP)", lambda to: fetching.pull(ctx, to, limit=size)),  # type: ignore[arg-type]
            ("agent chunk requests (before)", lambda to: chunk_pull(transport, str(source), to)),
            ("scp -r (OpenSSH)", lambda to: scp_pull(host, str(source), to)),
        ]
        rows = [(name, timed(copy, source, Path(tmp), args.repeat)) for name, copy in ways]
        transport.close()
    ssh_version = subprocess.run(["ssh", "-V"], capture_output=True, text=True, check=False).stderr.strip()
    lines = [
        "## Pull (bench/pull.py)", "",
        (f"`python bench/pull.py --mib {args.mib} --repeat {args.repeat}` — one sshd on loopback (tests/sshd.py), "
        f"a run dir of {args.mib} MiB (one file of random bytes, a 4 MiB log, 64 files of 16 KiB), copied into "
        f"a fresh folder on a connection already up; median wall time of {args.repeat} copies, each checked byte "
        f"for byte. CPython {platform.python_version()}, {os.cpu_count()} CPUs, {ssh_version}; paramiko "
        f"{__import__('paramiko').__version__}, read-ahead {ssh.READ_AHEAD >> 20} MiB in requests of "
        f"{ssh.SFTP_PIECE >> 10} KiB."), "",
        "| way | median wall s | MiB/s | vs orch pull |", "|---|---:|---:|---:|",
    ]
    ours = rows[0][1]
    for name, wall in rows:
        lines.append(f"| {name} | {wall:.2f} | {args.mib / wall:.0f} | {wall / ours:.1f}x |")
    section = "\n".join(lines) + "\n"
    print(section)
    write_section(section)


if __name__ == "__main__":
    main()
