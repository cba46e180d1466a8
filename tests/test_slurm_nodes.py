"""Runs of several nodes on a real two-node Slurm cluster (two slurmd on this machine, tests/slurmcluster.py):
one job of two nodes, its script run once per node through srun, through the real `orch` CLI."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurmcluster import SlurmCluster, missing, running

from orchestrator.host import slurm
from orchestrator.store import Store

POLL = ["--set", "poll_min=0.05", "--set", "poll_max=0.3"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = missing()
    if why:
        pytest.skip(why)
    with running(SlurmCluster(tmp_path_factory.mktemp("slurm2"), gpus=2, cpus=2, nodes=2, name="orchtest2")) as c:  # orch (and its sbatch/squeue) find this cluster, never /etc/slurm
        yield c


@pytest.fixture
def orch_hosts(tmp_path: Path, cluster: SlurmCluster) -> Iterator[str]:
    shared = tmp_path / "shared"
    yield (f"[hosts.cluster]\nscheduler = \"slurm\"\ngpus = 2\n"
           f"workdir = {json.dumps(str(shared))}\npython = {json.dumps(sys.executable)}\npoll_min = 0.3\npoll_max = 1\n")
    cluster.cancel_all()  # nothing of one test is left holding the node's GPUs for the next


def next_job_id(cluster: SlurmCluster) -> int:
    for line in cluster.client("scontrol", "show", "config", check=True).stdout.splitlines():
        if line.startswith("NEXT_JOB_ID"):
            return int(line.split("=")[1])
    raise AssertionError("scontrol show config names no NEXT_JOB_ID")


def test_a_two_node_run_is_one_job_whose_script_runs_once_per_node(orch, cluster):
    say = ('echo "rank=$NODE_RANK of $NNODES master=$MASTER_ADDR:$MASTER_PORT on=$SLURMD_NODENAME '
           'gpus=$CUDA_VISIBLE_DEVICES"; if [ "$NODE_RANK" = 0 ]; then echo "orch-metric loss=1.5"; fi')
    res = orch("run", "command", "--host", "cluster", "--set", f"cmd={say}", "--set", "nodes=2",
               "--set", "gpus=[0]", *POLL)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "succeeded" and doc["exit_code"] == 0
    job_id = doc["job_id"]
    # one job on both nodes, one task on each; the run stays one record
    shape = cluster.client("squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T %D %N").stdout.strip()
    assert shape == "COMPLETED 2 node[0-1]"
    port = slurm.PORT_BASE + job_id % slurm.PORT_SPAN  # nothing listens there: the head keeps it
    lines = sorted(line for line in orch("logs", "1", check=0).stdout.splitlines() if "rank=" in line)
    assert lines == [f"0: rank=0 of 2 master=node0:{port} on=node0 gpus=0",
                     f"1: rank=1 of 2 master=node0:{port} on=node1 gpus=0"]
    assert doc["metrics"]["loss"] == 1.5  # the head's lines are read through srun's label
    store = Store(orch.db)
    try:
        assert store.nodes_of(1) == [] and store.count_runs() == 1
    finally:
        store.close()


def test_a_node_that_fails_ends_the_job_and_the_run_fails(orch, cluster):
    # rank 0 would wait forever: only the job's end, on rank 1's exit, can end it
    # (a pause before the exit: srun forwards a task's output on its own time, and a line printed right
    # before the exit was seen missing from the log once srun had ended the step)
    cmd = 'if [ "$NODE_RANK" = 1 ]; then echo "rank 1 gives up"; sleep 1; exit 3; fi; sleep 100000'
    res = orch("run", "command", "--host", "cluster", "--set", f"cmd={cmd}", "--set", "nodes=2",
               "--set", "gpus=[0]", *POLL)
    assert res.returncode != 0
    doc = orch.status(1)
    # srun ends rank 0 (SIGTERM) and exits with its own code: the run's is that (143), or none when orch
    # stopped the job first on the fatal line the cancelled step left in the log
    assert doc["status"] == "failed" and doc["exit_code"] in (143, None), doc
    log = orch("logs", "1", check=0).stdout
    assert "1: rank 1 gives up" in log and "srun: error: node1: task 1: Exited with exit code 3" in log
    # rank 0 ended by the step's end: its shell's own word (forwarded with its label) when its sleep got the
    # SIGTERM first, srun's when the shell did, or the cancellation's
    stopped = ("0: Terminated", "srun: error: node0: task 0: Terminated")
    assert any(line in stopped for line in log.splitlines()) or "CANCELLED" in log, log


def test_the_head_moves_past_a_rendezvous_port_already_taken(orch, cluster):
    job_id = next_job_id(cluster)
    taken = slurm.PORT_BASE + job_id % slurm.PORT_SPAN
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", taken))
        listener.listen(8)
        res = orch("run", "command", "--host", "cluster", "--set", 'cmd=echo "port=$MASTER_PORT"',
                   "--set", "nodes=2", "--set", "gpus=[0]", *POLL)
    assert res.returncode == 0, res.stderr
    assert orch.status(1)["job_id"] == job_id
    lines = sorted(line for line in orch("logs", "1", check=0).stdout.splitlines() if "port=" in line)
    assert lines == [f"0: port={taken + 1}", f"1: port={taken + 1}"]


def test_a_port_in_the_runs_env_is_the_rendezvous_port(orch, cluster):
    res = orch("run", "command", "--host", "cluster", "--set", 'cmd=echo "port=$MASTER_PORT"',
               "--set", "nodes=2", "--set", "gpus=[0]", "--set", "env.MASTER_PORT=29511", *POLL)
    assert res.returncode == 0, res.stderr
    lines = sorted(line for line in orch("logs", "1", check=0).stdout.splitlines() if "port=" in line)
    assert lines == ["0: port=29511", "1: port=29511"]
