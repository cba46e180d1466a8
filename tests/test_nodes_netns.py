"""Runs across hosts that are network namespaces, each with its own address and sshd (tests/nethosts.py):
a real torch.distributed job through torchrun, and SGLang's multi-node serving as the emulator plays it —
ready when its head is, failed and stopped on every node when a rank on another node dies."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from orchtest import FAST, Orch, processes

TESTS = Path(__file__).parent
EMULATOR = TESTS / "fakes" / "sglang_emulator.py"


def workspace(tmp_path: Path, hosts) -> Orch:
    # the interface the ranks talk over: gloo would otherwise offer its peers the hostname's loopback address
    return Orch(tmp_path / "ws", hosts.hosts_toml(**{hosts.name(i): {"ifname": hosts.interface(i)}
                                                     for i in range(1, hosts.n + 1)}))


def test_torchrun_across_two_hosts_reaches_its_all_reduce_on_every_rank(tmp_path, net_hosts) -> None:
    hosts = net_hosts(2)
    orch = workspace(tmp_path, hosts)
    cmd = (f"cmd=cd {TESTS / 'jobs'} && {sys.executable} -m torch.distributed.run --nnodes $NNODES "
           "--node-rank $NODE_RANK --nproc-per-node 1 --master-addr $MASTER_ADDR --master-port $MASTER_PORT "
           "allreduce_job.py")
    res = orch("run", "command", "--host", "net1", "--host", "net2", *FAST, "--set", cmd, timeout=300)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "succeeded" and [n["host"] for n in doc["nodes"]] == ["net1", "net2"]
    for rank, run_id in enumerate(n["id"] for n in doc["nodes"]):
        node = orch.status(run_id)
        assert node["status"] == "succeeded"
        assert node["metrics"]["allreduce_sum"] == 3 and node["metrics"]["world_size"] == 2
        assert node["metrics"]["rank"] == rank  # each node's own rank reached the reduce
    assert f"--master-addr {hosts.address(1)}" not in res.stderr  # (the rendezvous came from the env)
    log = orch("logs", "2").stdout
    assert "rank 1 of world size 2 on node 1: all_reduce sum = 3" in log


def test_sglang_across_two_hosts_is_ready_with_its_head_and_fails_whole_when_a_rank_dies(tmp_path,
                                                                                     net_hosts) -> None:
    hosts = net_hosts(2)
    orch = workspace(tmp_path, hosts)
    tag = str(tmp_path / "ranks.events")  # finds this test's ranks among the machine's processes
    cmd = (f"cmd={sys.executable} {EMULATOR} --nnodes $NNODES --node-rank $NODE_RANK "
           f"--dist-init-addr $MASTER_ADDR:$MASTER_PORT --tp-size 16 --shards 3 --shard-time 0.05 --port 30000 "
           f"--serve-after 600 --events {tag}")
    res = orch("run", "command", "--host", "net1", "--host", "net2", "--until-ready", *FAST, "--set", cmd,
               "--set", "engine=sglang", timeout=120)
    assert res.returncode == 0, res.stderr
    head = orch.status(1)
    assert head["status"] == "running" and head["phase"] == "ready"
    worker_id = head["nodes"][1]["id"]
    worker = orch.status(worker_id)
    assert worker["status"] == "running" and worker["phase"] != "ready"  # SGLang's other nodes never say ready
    ranks = processes(tag)
    assert len(ranks) == 2
    [rank1] = [pid for pid, line in ranks.items() if "--node-rank 1" in line]
    os.kill(rank1, signal.SIGKILL)
    head = orch.wait_for(1, lambda d: d["status"] == "failed", timeout=60)
    assert head["reason"].startswith("node 1 (net2) failed: exit code 137 (killed by SIGKILL)"), head["reason"]
    assert orch.status(worker_id)["status"] == "failed"
    head = orch.wait_for(1, lambda d: any(e["kind"] == "stopped" for e in d["events"]), timeout=60)
    assert [e["message"] for e in head["events"] if e["kind"] == "stopped"] == ["process group: stopped"]
    # nothing of the run is left on either node: the head hung as a real group does, and was stopped
    deadline = time.time() + 30
    while processes(tag) and time.time() < deadline:
        time.sleep(0.1)
    assert processes(tag) == {}
