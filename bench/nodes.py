"""A run across two nodes: how fast does a rank dying on one node end the run and stop the other node, with orch
and with what a user does by hand, and what does each extra node cost at start-up?

Two hosts, each a Linux network namespace with its own address and sshd (tests/nethosts.py; needs root), and
orch run as a user runs it (`python -m orchestrator`, ORCH_HOME a workspace of its own; tests/orchtest.py).
  failure    an emulated SGLang 0.5.23 server across both nodes (tests/fakes/sglang_emulator.py:
             `--nnodes 2 --node-rank R`), started with `orch run command --host net1 --host net2 --until-ready`
             and left to the background watcher; while its head serves, the rank on node 2 is SIGKILLed.
             Lag from the kill to (a) the run's head record ended failed (`ended_at`) and (b) the head's
             rank process gone (/proc polled every 10 ms). The same clock throughout: all on this machine.
  by hand    the same two ranks nohup'ed over ssh, watched by a plain loop that runs `ssh host kill -0 PID`
             for each node every 5 s and, finding one dead, `ssh`-kills the other: lag to notice, and to the
             head gone. The `sleep 600; tail` habit is stated, not run: the head hangs until a person looks.
  start-up   wall time of `orch run command --host net1 [--host net2] --detach --set cmd=sleep 30` to every
             node's record running, one host against two.
The kill comes a random 0-5 s after the head is ready, so a poll's phase is not always the same.
Writes its section of bench/RESULTS.md.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from nethosts import NetHosts
from orchtest import Orch, alive, cmdline, processes
from results import write_section

EMULATOR = ROOT / "tests" / "fakes" / "sglang_emulator.py"
REPEATS = 5
HAND_POLL_S = 5.0  # the hand-written watch loop's period
SLEEP_HABIT_S = 600.0
BAR_S = 2.0  # a rank's death must end the run and stop the other nodes within this


def rank_pid(marker: str, rank: int) -> int:
    """The emulator process of node `rank` (not the bash that runs it)."""
    [pid] = [p for p, line in processes(marker).items()
             if f"--node-rank {rank}" in line and str(EMULATOR) in line and not line.startswith(("bash", "/bin/"))]
    return pid


def gone_at(pid: int, timeout: float = 120) -> float:
    """When `pid` was first seen gone, polling /proc every 10 ms."""
    deadline = time.time() + timeout
    while alive(pid):
        if time.time() > deadline:
            raise RuntimeError(f"process {pid} still runs {timeout:.0f} s on")
        time.sleep(0.01)
    return time.time()


def wait_events(path: Path, word: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not (path.exists() and any(line.endswith(word) for line in path.read_text().splitlines())):
        if time.time() > deadline:
            raise RuntimeError(f"{path} never said {word}")
        time.sleep(0.02)


def end_everything(orch: Orch, marker: str) -> None:
    """What one repeat left: its background watchers (by ORCH_HOME) and any rank still running."""
    orch("cancel", "1", new_process=True, timeout=60)
    mine = f"ORCH_HOME={orch.root}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            if mine in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") and "orchestrator" in cmdline(int(entry)):
                os.kill(int(entry), signal.SIGKILL)
        except OSError:
            continue
    for pid in processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def workspace(root: Path, hosts: NetHosts) -> Orch:
    # the interface the ranks talk over, as a multi-node run's hosts name it
    return Orch(root, hosts.hosts_toml(**{hosts.name(i): {"ifname": hosts.interface(i)} for i in range(1, hosts.n + 1)}))


def emulator_cmd(events: Path, rank: str, addr: str, port: str, nnodes: str = "2", http_port: int = 30000) -> str:
    return (f"{shlex.quote(sys.executable)} {shlex.quote(str(EMULATOR))} --nnodes {nnodes} --node-rank {rank} "
            f"--dist-init-addr {addr}:{port} --tp-size 16 --shards 3 --shard-time 0.05 --port {http_port} "
            f"--serve-after 600 --events {shlex.quote(str(events))}")


def orch_failure(hosts: NetHosts, work: Path) -> dict[str, float]:
    orch = workspace(work / "ws", hosts)
    events = work / "ranks.events"  # names this repeat's ranks among the machine's processes
    cmd = "cmd=" + emulator_cmd(events, "$NODE_RANK", "$MASTER_ADDR", "$MASTER_PORT")
    try:
        res = orch("run", "command", "--host", "net1", "--host", "net2", "--until-ready", "--set", cmd,
                   "--set", "engine=sglang", new_process=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"orch run: exit {res.returncode}\n{res.stderr}")
        head, rank1 = rank_pid(str(events), 0), rank_pid(str(events), 1)
        time.sleep(random.uniform(0, HAND_POLL_S))
        killed = time.time()
        os.kill(rank1, signal.SIGKILL)
        head_gone = gone_at(head)
        doc = orch.wait_for(1, lambda d: d["ended_at"] is not None, timeout=60)
        if doc["status"] != "failed":
            raise RuntimeError(f"run ended {doc['status']}: {doc.get('reason')}")
        return {"recorded": doc["ended_at"] - killed, "stopped": head_gone - killed}
    finally:
        end_everything(orch, str(events))


def ssh(hosts: NetHosts, i: int, command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    argv = ["ssh", "-i", str(hosts.client_key), "-o", f"UserKnownHostsFile={hosts.known_hosts}", "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes", f"{hosts.user}@{hosts.address(i)}", command]
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout)


def by_hand(hosts: NetHosts, work: Path) -> dict[str, float]:
    events = work / "ranks.events"
    work.mkdir(parents=True, exist_ok=True)
    pids: dict[int, int] = {}
    try:
        for i, rank in ((1, 0), (2, 1)):
            line = emulator_cmd(events, str(rank), hosts.address(1), "29555", http_port=30001)
            log = work / f"node{i}.log"
            res = ssh(hosts, i, f"nohup {line} > {shlex.quote(str(log))} 2>&1 < /dev/null & echo $!")
            pids[i] = int(res.stdout.strip())
        wait_events(events, "ready")
        head, rank1 = rank_pid(str(events), 0), rank_pid(str(events), 1)
        assert (head, rank1) == (pids[1], pids[2]), (head, rank1, pids)
        # the loop starts with the server up, as a user's would; the kill comes at a random point of its period
        loop_start = time.time()
        kill_at = loop_start + random.uniform(0, HAND_POLL_S)
        killed = noticed = None
        next_round = loop_start
        while noticed is None:
            for i in (1, 2):
                if killed is None and time.time() >= kill_at:
                    killed = time.time()
                    os.kill(rank1, signal.SIGKILL)
                if ssh(hosts, i, f"kill -0 {pids[i]}").returncode != 0:
                    noticed = time.time()
                    other = 3 - i
                    ssh(hosts, other, f"kill {pids[other]}")
                    break
            else:
                next_round += HAND_POLL_S
                while time.time() < next_round:
                    if killed is None and time.time() >= kill_at:
                        killed = time.time()
                        os.kill(rank1, signal.SIGKILL)
                    time.sleep(0.01)
        assert killed is not None
        head_gone = gone_at(head)
        return {"noticed": noticed - killed, "stopped": head_gone - killed}
    finally:
        for pid in processes(str(events)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_up(hosts: NetHosts, work: Path, n: int) -> float:
    orch = workspace(work / "ws", hosts)
    host_args = [a for i in range(1, n + 1) for a in ("--host", hosts.name(i))]
    try:
        began = time.time()
        res = orch("run", "command", *host_args, "--detach", "--set", "cmd=sleep 30", new_process=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"orch run --detach: exit {res.returncode}\n{res.stderr}")
        doc = orch.wait_for(1, lambda d: d["status"] == "running" and all(
            orch.status(node["id"])["status"] == "running" for node in d["nodes"]), timeout=60)
        took = time.time() - began
        if len(doc["nodes"]) != (n if n > 1 else 0):
            raise RuntimeError(f"{len(doc['nodes'])} node records for {n} hosts")
        return took
    finally:
        end_everything(orch, f"ORCH_HOME-unused-{work}")


def summary(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), max(values)


def main() -> None:
    global REPEATS
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=REPEATS)
    REPEATS = ap.parse_args().repeats
    if os.geteuid() != 0:
        sys.exit("bench/nodes.py needs root (network namespaces)")
    began = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        hosts = NetHosts(2, root=Path(tmp) / "hosts")
        try:
            hosts.start()
            # the first run on fresh hosts starts each host's agent: timed on its own, not counted
            cold = start_up(hosts, Path(tmp) / "cold", 2)
            print(f"start-up on fresh hosts, two hosts: {cold:.2f} s", flush=True)
            startup: dict[int, list[float]] = {1: [], 2: []}
            for i in range(REPEATS):
                for n in (1, 2):
                    startup[n].append(start_up(hosts, Path(tmp) / f"start-{n}-{i}", n))
                print(f"start-up {i + 1}: one host {startup[1][-1]:.2f} s, two hosts {startup[2][-1]:.2f} s", flush=True)
            failure: dict[str, list[float]] = {}
            hand: dict[str, list[float]] = {}
            for i in range(REPEATS):
                for key, value in orch_failure(hosts, Path(tmp) / f"orch-{i}").items():
                    failure.setdefault(key, []).append(value)
                for key, value in by_hand(hosts, Path(tmp) / f"hand-{i}").items():
                    hand.setdefault(key, []).append(value)
                print(f"repeat {i + 1}: orch recorded {failure['recorded'][-1]:.2f} s, head stopped"
                      f" {failure['stopped'][-1]:.2f} s; by hand noticed {hand['noticed'][-1]:.2f} s, head stopped"
                      f" {hand['stopped'][-1]:.2f} s", flush=True)
        finally:
            hosts.close()
    print(f"took {time.time() - began:.0f} s", flush=True)
    write(failure, hand, startup, cold)


def write(failure: dict[str, list[float]], hand: dict[str, list[float]], startup: dict[int, list[float]],
          cold: float) -> None:
    rows: list[tuple[str, str, tuple[float, float]]] = [
        ("rank on node 2 SIGKILLed", "orch: run recorded failed", summary(failure["recorded"])),
        ("rank on node 2 SIGKILLed", "orch: head's rank stopped", summary(failure["stopped"])),
        ("rank on node 2 SIGKILLed", "by hand, ssh kill -0 loop every 5 s: noticed", summary(hand["noticed"])),
        ("rank on node 2 SIGKILLed", "by hand, ssh kill -0 loop every 5 s: head stopped", summary(hand["stopped"])),
        ("start-up", "orch run --detach, one host (net1)", summary(startup[1])),
        ("start-up", "orch run --detach, two hosts (net1, net2)", summary(startup[2])),
    ]
    for what, who, (median, worst) in rows:
        print(f"{what:26} {who:52} median {median:6.2f} s  max {worst:6.2f} s")
    orch_stop, hand_stop = summary(failure["stopped"]), summary(hand["stopped"])
    per_node = summary(startup[2])[0] - summary(startup[1])[0]
    lines = [
        "## Multi-node runs (bench/nodes.py)",
        "",
        ("Two hosts, each a Linux network namespace with its own address and a real sshd (tests/nethosts.py), on"
        " the development machine (2 cores, shared); orch run as a user runs it (`python -m orchestrator`, a"
        " workspace of its own, default poll settings). An emulated SGLang 0.5.23 server spans both nodes"
        " (`--nnodes 2`), started with `orch run command --host net1 --host net2 --until-ready` and left to"
        " its background watcher; a random 0-5 s after the head is ready the rank on node 2 is SIGKILLed. The"
        " head does not exit by itself (a real group hangs in its collective). Lag from the kill to the run"
        " recorded failed (`ended_at`) and to the head's rank process gone (/proc polled every 10 ms). By hand:"
        " the same two ranks nohup'ed over ssh, a loop running `ssh host kill -0 PID` for each node every 5 s"
        " and ssh-killing the other node's rank on finding one dead. Start-up: `orch run command --host net1"
        " [--host net2] --detach --set cmd=sleep 30` to every node's record running, after a first"
        " two-host run on the fresh hosts, reported apart (the first run on a host starts its agent)."
        f" Median and max of {REPEATS} runs, real seconds."),
        "",
        "| case | who | median (s) | max (s) |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {what} | {who} | {median:.2f} | {worst:.2f} |" for what, who, (median, worst) in rows]
    lines += [
        "",
        (f"orch ends the run and stops the head within the {BAR_S:.0f} s bar: max {orch_stop[1]:.2f} s"
        f" ({'met' if orch_stop[1] <= BAR_S and summary(failure['recorded'])[1] <= BAR_S else 'NOT met'})."
        f" The hand-written ssh loop takes {hand_stop[0] / orch_stop[0]:.1f}x orch's median to stop the head"
        f" (max {hand_stop[1] / orch_stop[1]:.1f}x), and costs two ssh round trips every 5 s for as long as the"
        f" server runs. The `sleep {SLEEP_HABIT_S:.0f}; tail` habit (not run) leaves the head hanging, holding"
        f" its node's GPUs, until a person looks: up to {SLEEP_HABIT_S:.0f} s, {SLEEP_HABIT_S / orch_stop[0]:.0f}x"
        f" orch's median, and nothing stops it then but the person. Each node beyond the first adds"
        f" {per_node:.2f} s to a detached start (median two hosts minus median one host); the first"
        f" run on fresh hosts, which starts both hosts' agents, took {cold:.2f} s."),
        "",
    ]
    write_section("\n".join(lines))
    print("wrote the multi-node section of bench/RESULTS.md")


if __name__ == "__main__":
    main()
