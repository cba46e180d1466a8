"""The multi-node test kit: hosts as network namespaces (tests/nethosts.py), the SGLang emulator's
multi-node form, and a real torch.distributed job across two such hosts."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from nethosts import NetHosts
from sshd import free_port

TESTS = Path(__file__).parent
EMULATOR = TESTS / "fakes" / "sglang_emulator.py"
ALLREDUCE = TESTS / "jobs" / "allreduce_job.py"


def wait_until(check: Callable[[], object], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in {timeout} s: {what}")
        time.sleep(0.02)


def ssh(hosts: NetHosts, i: int, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run command on host i through its sshd, with strict host-key checking."""
    e = hosts.host_entry(i)
    return subprocess.run(
        ["ssh", "-i", e["identity_file"], "-o", f"UserKnownHostsFile={e['known_hosts']}",
         "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
         "-p", str(e["port"]), f"{e['user']}@{e['address']}", command],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


# ---------------------------------------------------------------------------------------------------
# NetHosts
# ---------------------------------------------------------------------------------------------------


def test_a_host_reached_over_ssh_reaches_a_port_open_on_another(net_hosts, tmp_path: Path) -> None:
    hosts = net_hosts(2)
    listen = (
        "import socket\n"
        f"s = socket.create_server(({hosts.address(2)!r}, 7001))\n"
        "print('listening', flush=True)\n"
        "c, peer = s.accept()\n"
        "c.sendall(f'hello {peer[0]} from net2'.encode())\n"
        "c.close()\n"
    )
    server = subprocess.Popen([*hosts.exec_prefix(2), sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "listening\n"
        res = ssh(hosts, 1, f"{sys.executable} -c \"import socket; "
                            f"print(socket.create_connection(('{hosts.address(2)}', 7001), timeout=10).recv(100).decode())\"")
        assert res.returncode == 0, res.stderr
        # host 2 saw the connection come from host 1's own address: the command ran in host 1's namespace
        assert res.stdout.strip() == f"hello {hosts.address(1)} from net2"
        assert server.wait(10) == 0
    finally:
        server.kill()
        server.wait()
    entries = tomllib.loads(hosts.hosts_toml())["hosts"]
    assert list(entries) == ["net1", "net2"]
    assert entries["net1"]["address"] != entries["net2"]["address"]
    assert entries["net1"]["workdir"] != entries["net2"]["workdir"]
    assert entries["net2"] == hosts.host_entry(2)


def test_close_removes_the_namespaces_and_links_even_after_a_failed_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, net_hosts) -> None:
    hosts = net_hosts(2)
    names, ifs, bridge = list(hosts.namespaces), list(hosts.outer_ifs), hosts.bridge
    assert all(ns in namespaces() for ns in names) and bridge in links()
    hosts.close()
    assert not any(ns in namespaces() for ns in names)
    assert not any(f" {name}@" in links() or f" {name}:" in links() for name in [*ifs, bridge])

    import nethosts

    def refuse(self: object, timeout: float = 15) -> None:
        raise RuntimeError("sshd refused to start")

    monkeypatch.setattr(nethosts.SSHServer, "start", refuse)
    half = NetHosts(2, root=tmp_path / "half")
    with pytest.raises(RuntimeError, match="refused"):
        half.start()  # the network was made, the servers failed
    assert not any(ns in namespaces() for ns in half.namespaces)
    assert f" {half.bridge}:" not in links()


def test_torchrun_spans_two_hosts(net_hosts) -> None:
    pytest.importorskip("torch")
    hosts = net_hosts(2)
    port = 29400 + hosts.subnet  # type: ignore[operator]
    # the hosts share the machine's hostname, which /etc/hosts makes 127.0.0.1: gloo is told its interface
    command = (f"cd {TESTS} && GLOO_SOCKET_IFNAME={hosts.interface(1)} {sys.executable} -m torch.distributed.run "
               f"--nnodes 2 --node-rank {{rank}} --nproc-per-node 1 --master-addr {hosts.address(1)} "
               f"--master-port {port} {ALLREDUCE}")
    e = hosts.host_entry(1)
    ranks = [subprocess.Popen(
        ["ssh", "-i", e["identity_file"], "-o", f"UserKnownHostsFile={e['known_hosts']}", "-o", "BatchMode=yes",
         "-p", str(e["port"]), f"{e['user']}@{hosts.address(i)}", command.format(rank=i - 1)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL) for i in (1, 2)]
    outs = [p.communicate(timeout=150)[0] for p in ranks]
    for rank, (p, out) in enumerate(zip(ranks, outs)):
        assert p.returncode == 0, out
        assert f"rank {rank} of world size 2 on node {rank}: all_reduce sum = 3" in out
        assert f"orch-metric allreduce_sum=3 world_size=2 rank={rank}" in out


# ---------------------------------------------------------------------------------------------------
# The SGLang emulator across nodes (in this namespace, on loopback)
# ---------------------------------------------------------------------------------------------------


def emulator(tmp_path: Path, name: str, rank: int, dist: str, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(EMULATOR), "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", dist,
         "--tp-size", "16", "--shards", "3", "--events", str(tmp_path / f"{name}.events"), *extra],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{name}.log").open("wb"), stdin=subprocess.DEVNULL)


def events(tmp_path: Path, name: str) -> list[str]:
    try:
        return [line.split(" ", 1)[1] for line in (tmp_path / f"{name}.events").read_text().splitlines()]
    except FileNotFoundError:
        return []


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as res:
            return res.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_head_is_ready_only_once_the_worker_joined_and_hangs_when_it_dies(tmp_path: Path) -> None:
    dist, http = f"127.0.0.1:{free_port('127.0.0.1')}", free_port("127.0.0.1")
    gate = tmp_path / "end"
    head = emulator(tmp_path, "head", 0, dist, "--port", str(http), "--pause", f"end:{gate}")
    worker = None
    try:
        wait_until(lambda: "Init torch distributed begin." in (tmp_path / "head.log").read_text(), "head waits")
        assert health(http) == 503
        worker = emulator(tmp_path, "worker", 1, dist)
        wait_until(lambda: "loaded" in events(tmp_path, "worker") and "ready" in events(tmp_path, "head"), "both up")
        assert events(tmp_path, "head")[:3] == ["start", "joined:1", "ready"]
        assert health(http) == 200
        head_log, worker_log = (tmp_path / "head.log").read_text(), (tmp_path / "worker.log").read_text()
        assert "The server is fired up and ready to roll!" in head_log
        assert "TP8] Load weight begin" in worker_log and "Capture target decode CUDA graph end" in worker_log
        assert "ready to roll" not in worker_log and " TP0]" not in worker_log

        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        wait_until(lambda: "peer-lost" in events(tmp_path, "head"), "the head notices")
        gate.touch()  # a head that did not hang would now end
        with pytest.raises(subprocess.TimeoutExpired):
            head.wait(1)
        assert health(http) == 503
        assert (tmp_path / "head.log").read_text() == head_log  # not a line more
    finally:
        for p in (head, worker):
            if p is not None:
                p.kill()
                p.wait()


def test_a_worker_waits_for_its_head_and_fails_when_the_head_goes(tmp_path: Path) -> None:
    dist = f"127.0.0.1:{free_port('127.0.0.1')}"
    worker = emulator(tmp_path, "worker", 1, dist)
    head = None
    try:
        wait_until(lambda: "Init torch distributed begin." in (tmp_path / "worker.log").read_text(), "worker waits")
        head = emulator(tmp_path, "head", 0, dist)  # no --port, no pause: ends right after ready
        assert head.wait(30) == 0
        assert worker.wait(30) == 137
        log = (tmp_path / "worker.log").read_text()
        assert "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 8" in log
        assert events(tmp_path, "worker")[-1] == "head-lost"
    finally:
        for p in (head, worker):
            if p is not None:
                p.kill()
                p.wait()
