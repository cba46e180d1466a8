"""The dry run is the start's own steps against a host that records them: it sends, in words, what a real
start sends, a step a playbook adds shows up with no description of its own, and it creates nothing —
no file on the host, no run in the database — while bad input is refused as a start refuses it."""

from __future__ import annotations

import json
import posixpath
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hostdirs import HostDirs
from orchtest import in_process

from orchestrator import runflow
from orchestrator.config.hosts import local_host
from orchestrator.config.workspace import Workspace
from orchestrator.host import agent
from orchestrator.host.transport import LocalTransport
from orchestrator.playbook import Prepared, RunContext
from orchestrator.store import Store
from orchestrator.watch import follow
from playbooks.command import Command, CommandSpec

Orch = Callable[..., tuple[int, str, str]]


class Probing(Command):
    """`command` with steps of its own: a look before anything changes, an upload and a program run."""

    def preflight(self, run: RunContext[CommandSpec]) -> None:
        run.remote.exists("input.txt")

    def prepare(self, run: RunContext[CommandSpec]) -> Prepared:
        run.remote.put(b"exit 0\n", posixpath.join(run.paths.root, "helper.sh"))
        run.remote.run_argv(["true"])
        return Prepared(env={"PROBED": "1"})


def _key(op: str, args: dict[str, Any]) -> str:
    """A request to the agent as the comparison sees it: the op, what it acts on, and for a host program
    which one and its action."""
    if op == "program":
        return f"{args['entry']} {json.loads(args['input'])['action']}"
    if op == "lease":
        return f"leases {args['action']}"
    return " ".join([op, *(str(args[k]) for k in ("path", "dir", "argv") if k in args)])


def record_real_requests(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], dict[str, str]]:
    """What this process sends to hosts from now on, in order (requests to agents, uploads), and the
    job script its launch sends."""
    sent: list[str] = []
    launched: dict[str, str] = {}
    call, put = agent.AgentLink.call, LocalTransport.put

    def calling(link: agent.AgentLink, op: str, timeout: float = 60, **args: Any) -> dict[str, Any]:
        if op not in ("hello", "ping", "ack"):
            sent.append(_key(op, args))
        if op == "launch":
            launched["script"] = args["script"]
        return call(link, op, timeout, **args)

    def putting(transport: LocalTransport, data: bytes, path: str, mode: int = 0o644) -> None:
        sent.append(f"upload {path}")
        put(transport, data, path, mode)

    monkeypatch.setattr(agent.AgentLink, "call", calling)
    monkeypatch.setattr(LocalTransport, "put", putting)
    return sent, launched


def test_the_dry_run_sends_what_a_start_sends_with_a_playbooks_own_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    host = local_host(tmp_path)
    pb = Probing()
    # cleanup off: what the GPU step asks depends on whether this machine has GPUs; the rest does not
    spec = CommandSpec(cmd="sh helper.sh", cleanup=False, poll_min=0.05, poll_max=0.2)
    # a first run places orch's host programs, which a start uploads only to a host that lacks them
    follow.watch(runflow.start(ws, store, Command(), CommandSpec(cmd="true", cleanup=False), host))

    dry = runflow.dry_run(ws, store, pb, spec, [host])
    sending, launched = record_real_requests(monkeypatch)
    run = runflow.start(ws, store, pb, spec, host)
    sent = list(sending)  # what the start sent; watching the job is not the start's
    follow.watch(run)

    recorded = [_key(s.request["op"], s.request) if s.kind == "agent" else f"upload {s.request['path']}"
                for s in dry.steps if s.kind != "agent-start"]
    assert recorded == sent
    root = run.paths.root
    assert dry.run_id == run.run_id == 2
    # the playbook's own steps are there, in their place, with no description written for them
    assert sent == ["leases take", f"stat {root}/input.txt", f"upload {root}/helper.sh",
                    "exec ['true']", f"launch {root}"]
    assert dry.script == launched["script"] and "export PROBED=1" in launched["script"]
    text = dry.text()
    assert f"look at what is at {root}/input.txt" in text and f"upload 7 bytes to {root}/helper.sh" in text
    assert "run without a shell: true" in text
    assert run.record.status.value == "succeeded"
    store.close()


@pytest.fixture
def orch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Orch:
    """`orch ARGS` in a workspace of the test's own whose local host has 2 GPUs and a workdir apart."""
    monkeypatch.setenv("ORCH_HOME", str(tmp_path / "ws"))
    monkeypatch.setenv("COLUMNS", "200")
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "hosts.toml").write_text(f'[hosts.local]\nworkdir = "{tmp_path / "host"}"\ngpus = 2\n')
    return in_process(capsys)


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_dry_run_lists_the_start_and_creates_nothing(orch: Orch, tmp_path: Path) -> None:
    code, out, err = orch("run", "command", "--set", "cmd=echo hi", "--set", "gpus=[1]", "--dry-run")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("# dry run: command on local as run 1; nothing was created or sent")
    steps = [line for line in lines if line.startswith("# ") and line[2].isdigit()]
    assert [s.split(": ", 1)[1].split(" ", 1)[0] for s in steps] == [
        "start", "make", "look", "look", "write"]  # agent, run dir and lease files, GPUs twice, launch
    assert "the run's own (its token) and take the lease files gpu-1 in" in steps[1]
    assert "look at what holds GPUs 0,1 (nvidia-smi, /proc): answered as free" in steps[2]
    assert "(setsid)" in steps[-1] and out.endswith("export CUDA_VISIBLE_DEVICES=1\necho hi\n")
    assert not (tmp_path / "host").exists()  # the host's workdir: nothing placed, nothing taken
    assert files_under(tmp_path / "ws") == ["hosts.toml"]  # no database, no run dir, no lock

    code, out, err = orch("run", "command", "--set", "cmd=echo hi", "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["dry_run"], doc["playbook"], doc["host"], doc["run_id"]) == (True, "command", "local", 1)
    launch = doc["steps"][-1]
    assert launch["kind"] == "agent" and launch["request"]["op"] == "launch"
    assert launch["request"]["script"].endswith("export CUDA_VISIBLE_DEVICES=0,1\necho hi\n")
    assert files_under(tmp_path / "ws") == ["hosts.toml"] and not (tmp_path / "host").exists()


def test_a_dry_run_on_a_busy_host_says_so_and_adds_no_run(orch: Orch, tmp_path: Path) -> None:
    from orchestrator.store import lease
    from orchestrator.store.lifecycle import transition
    from orchestrator.store.record import Status

    store = Store(tmp_path / "ws" / "runs" / "orch.db")
    [held] = HostDirs(tmp_path / "ws", store, local=True).acquire(["local"], lambda: [store.create_run("command", "local", {"cmd": "x"})])
    for status in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, held, status)
    before = store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
    code, out, err = orch("run", "command", "--set", "cmd=true", "--dry-run")
    assert code == 0, err
    assert f"# note: a start now would not go ahead: host local is busy with run {held} (command, running" in out
    assert "# dry run: command on local as run 2" in out
    assert [r.id for r in store.list_runs()] == [held] and lease.held(store)[0].run_id == held
    assert store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0] == before
    assert store.next_run_id() == 2  # the id the dry run named is still free
    store.close()


@pytest.mark.parametrize("args, message", [
    (["run", "command", "--dry-run"], "cmd"),
    (["run", "command", "--set", "cmd=true", "--set", 'patches=["no-such-set"]', "--dry-run"], "no-such-set"),
    (["run", "command", "--set", "cmd=true", "--set", 'patches=["sglang-eagle3-hidden-debug"]', "--dry-run"],
     "--cuda-graph-backend-decode=disabled"),
    (["run", "command", "--host", "nowhere", "--set", "cmd=true", "--dry-run"], "unknown host"),
])
def test_bad_input_to_a_dry_run_exits_2_and_creates_nothing(orch: Orch, tmp_path: Path, args: list[str],
                                                            message: str) -> None:
    code, out, err = orch(*args)
    assert code == 2, (out, err)
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert out == ""
    assert files_under(tmp_path / "ws") == ["hosts.toml"] and not (tmp_path / "host").exists()


def test_a_dry_run_on_a_cluster_patches_the_runs_copy_and_submits(tmp_path: Path) -> None:
    from orchestrator.config.hosts import Host
    from orchestrator.host import hostlease
    from orchestrator.runflow import registry

    ws = Workspace(root=tmp_path / "ws", hosts_file=tmp_path / "ws" / "hosts.toml")
    cluster = Host(name="cl", scheduler="slurm", workdir=str(tmp_path / "cl"), partition="gpu", gpus=4)
    flags = "--cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled"
    spec = CommandSpec(cmd=f"python -m sglang.launch_server {flags}", patches=["sglang-eagle3-hidden-debug"])
    store = Store(":memory:")
    dry = runflow.dry_run(ws, store, Command(), spec, [cluster])
    store.close()
    root = hostlease.run_paths(ws, cluster.workdir, 1).root
    ops = [s.request.get("op", s.kind) for s in dry.steps]
    # no lease files asked nor GPUs looked at: the scheduler places the job
    assert ops == ["agent-start", "patch", "lease", "command", "program", "submit"]
    files = ", ".join(registry.patch_set("sglang-eagle3-hidden-debug").files)
    assert dry.steps[1].what == ("check that patch set sglang-eagle3-hidden-debug applies to sglang ==0.5.23 of "
                                 f"python3 ({files}); nothing written")
    assert dry.steps[2].what == f"make {root} the run's own (its token)"
    assert dry.steps[3].body == (f"mkdir -p {root}/overlay && cp -a -- '<site-packages of python3>/sglang' "
                                 f"{root}/overlay/")
    assert dry.steps[4].what.startswith(f"apply patch set sglang-eagle3-hidden-debug to the run's copy of sglang "
                                        f"in {root}/overlay (")
    assert dry.steps[5].what.endswith(f"sbatch --job-name=orch-1 --chdir={root} --output={root}/slurm.out "
                                      "--nodes=1 --gres=gpu:4 --partition=gpu")
    assert dry.script is not None and f"\nexport PYTHONPATH={root}/overlay$" in dry.script
    assert not (tmp_path / "cl").exists() and not (tmp_path / "ws").exists()


def test_a_dry_run_masks_the_secrets_of_the_hosts_env_too(orch: Orch, tmp_path: Path) -> None:
    """hosts.toml `env` reaches the job's script as the spec's does: what a dry run prints (text and JSON)
    shows each secret as `***`, by its name, a URL's password or the host's own `secret_env`."""
    (tmp_path / "ws" / "hosts.toml").write_text(
        f'[hosts.local]\nworkdir = "{tmp_path / "host"}"\nsecret_env = ["SITE_CRED"]\n'
        '[hosts.local.env]\nHF_TOKEN = "hf_S3CRET_a"\nNGC_API_KEY = "nvapi-S3CRET_b"\nGITHUB_PAT = "ghp_S3CRET_c"\n'
        'DATABASE_URL = "postgres://u:S3CRET_d@db:5432/x"\nSITE_CRED = "S3CRET_e"\n'
        'HF_TOKEN_PATH = "/etc/hf/token"\nNCCL_DEBUG = "INFO"\n')
    for args in ([], ["--json"]):
        code, out, err = orch("run", "command", "--set", "cmd=echo hi", "--set", "env.DB_PASS=S3CRET_f",
                              "--dry-run", *args)
        assert code == 0, err
        assert "S3CRET" not in out + err, out
        script = json.loads(out)["steps"][-1]["request"]["script"] if args else out
        for name in ("HF_TOKEN", "NGC_API_KEY", "GITHUB_PAT", "DATABASE_URL", "SITE_CRED", "DB_PASS"):
            assert f"export {name}='***'" in script, (name, script)
        assert "export HF_TOKEN_PATH=/etc/hf/token" in script and "export NCCL_DEBUG=INFO" in script, script
