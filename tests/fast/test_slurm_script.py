"""What a run of several nodes submits to Slurm: its sbatch options and its job script, as generated, and as
a dry run shows them (the real cluster runs them in tests/test_slurm_nodes.py)."""

from __future__ import annotations

from pathlib import Path

from orchestrator import runflow
from orchestrator.config.hosts import Host
from orchestrator.config.workspace import Workspace
from orchestrator.host import hostlease, slurm
from orchestrator.host.launch import RunPaths
from orchestrator.store import Store
from playbooks.command import Command, CommandSpec

CLUSTER = Host(name="cl", scheduler="slurm", workdir="/shared/orch", partition="gpu", gpus=4)


def test_one_node_asks_for_one_node_and_keeps_its_script() -> None:
    paths = RunPaths("/shared/orch/runs/w/7")
    assert slurm.sbatch_args(CLUSTER, paths, 2) == [
        "--job-name=orch-7", "--chdir=/shared/orch/runs/w/7", "--output=/shared/orch/runs/w/7/slurm.out",
        "--nodes=1", "--gres=gpu:2", "--partition=gpu"]
    assert slurm.sbatch_args(CLUSTER, paths, 2, nodes=1) == slurm.sbatch_args(CLUSTER, paths, 2)
    script = "export PYTHONUNBUFFERED=1\necho hi\n"
    assert slurm.node_script(script, 1) == script


def test_several_nodes_ask_for_one_task_on_each_and_their_gpus_on_each() -> None:
    args = slurm.sbatch_args(CLUSTER, RunPaths("/shared/orch/runs/w/7"), 2, nodes=3)
    assert args[3:] == ["--nodes=3", "--ntasks-per-node=1", "--gres=gpu:2", "--partition=gpu"]


def test_several_nodes_run_the_script_once_per_node_through_srun_its_own_env_last() -> None:
    script = "export PYTHONUNBUFFERED=1\nexport MASTER_PORT=29500\necho \"$NODE_RANK\"\n"
    text = slurm.node_script(script, 2)
    assert text.endswith("\n" + script) and text.startswith(slurm.NODE_PRELUDE)
    prelude = slurm.NODE_PRELUDE
    # the batch step starts the tasks, each task runs the job's lines with its rank
    assert ("exec srun --nodes=\"$NNODES\" --ntasks=\"$NNODES\" --ntasks-per-node=1 --kill-on-bad-exit=1 --label"
            in prelude)
    assert 'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in prelude
    assert 'export NNODES="${SLURM_JOB_NUM_NODES:-$SLURM_NNODES}"' in prelude
    assert prelude.rstrip().endswith('export NODE_RANK="$SLURM_NODEID"')


def test_a_dry_run_of_two_nodes_on_a_cluster_shows_the_nodes_and_the_script(tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path / "ws", hosts_file=tmp_path / "ws" / "hosts.toml")
    cluster = Host(name="cl", scheduler="slurm", workdir=str(tmp_path / "cl"), gpus=4)
    store = Store(":memory:")
    dry = runflow.dry_run(ws, store, Command(), CommandSpec(cmd='echo "$NODE_RANK"', nodes=2, gpus=[0, 1]),
                          [cluster])
    store.close()
    root = hostlease.run_paths(ws, cluster.workdir, 1).root
    submit = [s for s in dry.steps if s.request.get("op") == "submit"]
    assert len(submit) == 1 and submit[0].what.endswith(
        f"sbatch --job-name=orch-1 --chdir={root} --output={root}/slurm.out --nodes=2 --ntasks-per-node=1 "
        "--gres=gpu:2")
    assert dry.script is not None and dry.script.startswith(slurm.NODE_PRELUDE)
    assert dry.script.rstrip().endswith('echo "$NODE_RANK"')
    assert not (tmp_path / "cl").exists()
