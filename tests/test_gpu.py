"""GPU hygiene against real processes, with the tests-only `nvidia-smi` stand-in (tests/fakes) on PATH."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from orchtest import alive

from orchestrator import runflow
from orchestrator.config.hosts import local_host
from orchestrator.config.spec import RunSpec
from orchestrator.config.workspace import Workspace
from orchestrator.errors import OrchError
from orchestrator.host import gpu, launch
from orchestrator.host.executor import executor_for
from orchestrator.host.launch import HostExecutor, RunPaths
from orchestrator.host.remote import connect
from orchestrator.runflow import registry
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import JobRef, Status

pytest_plugins = ["engine_src"]  # engine: real sglang 0.5.23 source, for a patch set inside a run

FAKES = Path(__file__).resolve().parent / "fakes"
NO_SLEEP = lambda s: None


class FastSpec(RunSpec):
    """A spec with the cleanup timings a test waits for (the step takes them as arguments)."""

    cleanup_timeout_s: float = 20
    kill_grace_s: float = 0.5


# --- fixtures and helpers --------------------------------------------------------------------------


def wait_for(predicate: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


class FakeGpus:
    """Writes the stand-in's state file."""

    def __init__(self, path: Path, count: int = 2):
        self.path = path
        self.state: dict[str, Any] = {
            "gpus": [
                {"index": i, "uuid": f"GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e9{i}", "memory_total": 143771,
                 "utilization": 0}
                for i in range(count)
            ],
            "processes": [],
        }
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.state))

    def add(self, pid: int, gpu_index: int, used_memory: int = 20000) -> None:
        self.state["processes"].append({"pid": pid, "gpu": gpu_index, "used_memory": used_memory})
        self.save()

    def set_gpu(self, index: int, **fields: Any) -> None:
        self.state["gpus"][index].update(fields)
        self.save()


@pytest.fixture
def fake_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeGpus:
    assert os.access(FAKES / "nvidia-smi", os.X_OK), "tests/fakes/nvidia-smi must be executable"
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    fake = FakeGpus(tmp_path / "gpu-state.json")
    monkeypatch.setenv("ORCH_FAKE_GPU_STATE", str(fake.path))
    return fake


@pytest.fixture
def no_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    """PATH without any nvidia-smi, real or stand-in."""
    dirs = [d for d in os.environ["PATH"].split(os.pathsep) if d and not (Path(d) / "nvidia-smi").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(dirs))


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    """Foreign processes a test starts; whatever is left is killed at the end."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def foreign(procs: list[subprocess.Popen], *argv: str) -> subprocess.Popen:
    p = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    procs.append(p)
    return p


@dataclass
class Starting:
    """The run being started, preparing, as the run flow has it when cleanup runs; env: what cleanup set."""

    run: runflow.Run
    env: dict[str, str] = field(default_factory=dict)

    @property
    def run_id(self) -> int:
        return self.run.run_id


def context(ws: Workspace, store: Store, spec: FastSpec) -> Starting:
    host = local_host(ws.root)
    run_id = store.create_run("command", host.name, spec.model_dump(mode="json"))
    transition(store, run_id, Status.PREPARING)
    transport = connect(host)
    return Starting(runflow.Run(ws, store, registry.playbook("command"), host, transport,
                                    executor_for(host, transport), run_id, spec,
                                    RunPaths.for_run(str(ws.root), run_id)))


def clean(starting: Starting, sleep: Callable[[float], None]) -> None:
    """The run flow's GPU cleanup step, with the spec's timings."""
    spec = starting.run.spec
    assert isinstance(spec, FastSpec)
    starting.env.update(runflow.free_gpus(starting.run, grace_s=spec.kill_grace_s, timeout_s=spec.cleanup_timeout_s,
                                          sleep=sleep))


class OrchJobs:
    """Real jobs started the way orch starts them; whatever is left is stopped at the end of the test."""

    def __init__(self, ws: Workspace, store: Store):
        self.ws, self.store = ws, store
        self.started: list[JobRef] = []

    def start(self, body: str) -> tuple[int, int, int]:
        """A job recorded as a running run. Returns (run id, wrapper pid, the job's own pid, which is
        what holds the GPU)."""
        host = local_host(self.ws.root)
        run_id = self.store.create_run("command", host.name, {"cmd": body})
        paths = RunPaths.for_run(str(self.ws.root), run_id)
        transition(self.store, run_id, Status.PREPARING)
        transition(self.store, run_id, Status.LAUNCHING)
        script = launch.job_script(f"echo $$ > job.pid\n{body}", {}, None)
        job = HostExecutor(connect(host)).launch(paths, script, f"test-{run_id}")
        self.started.append(job)
        transition(self.store, run_id, Status.RUNNING, f"pid {job.id}", **job.columns())
        job_pid_file = Path(paths.root) / "job.pid"
        wait_for(lambda: job_pid_file.exists() and job_pid_file.read_text().strip())
        return run_id, job.id, int(job_pid_file.read_text())

    def stop_all(self) -> None:
        for job in self.started:
            HostExecutor(connect(local_host(self.ws.root))).kill(job, 0.2)


@pytest.fixture
def orch_jobs(ws: Workspace, store: Store) -> Iterator[OrchJobs]:
    jobs = OrchJobs(ws, store)
    yield jobs
    jobs.stop_all()


def gpu_events(store: Store, run_id: int) -> list[dict[str, Any]]:
    return [e for e in store.events(run_id) if e["kind"] == "gpu"]


# --- parsing the real formats ----------------------------------------------------------------------

GPU_ROW = ("index", "uuid", "memory.used", "memory.total", "utilization.gpu")
APP_ROW = ("pid", "gpu_uuid", "used_memory")
# What the host's agent answers: nvidia-smi's cells as printed, and what /proc said of each process
REAL = {
    "nvidia_smi": True,
    "gpus": [dict(zip(GPU_ROW, r)) for r in (
        ("0", "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90", "105851", "143771", "100"),
        ("1", "GPU-7f1c2d3e-0000-1111-2222-333344445555", "[N/A]", "143771", "[Not Supported]"))],
    "apps": [dict(zip(APP_ROW, r)) for r in (
        ("4242", "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90", "105840"),
        ("4243", "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90", "[N/A]"))],
    "procs": {"4242": {"pgid": 4200, "user": "alice",
                       "command": "python -m sglang.launch_server --model-path /models/llama --tp 8",
                       "start": "123460", "group_start": "123456", "mark": None},
              "4243": None},
}


def test_parse_real_formats_with_na_and_invisible_pid() -> None:
    snap = gpu.parse_snapshot("gpu01", REAL)
    assert snap is not None
    g0, g1 = snap.gpus
    assert (g0.index, g0.memory_used_mib, g0.memory_total_mib, g0.utilization_pct) == (0, 105851, 143771, 100)
    assert (g1.memory_used_mib, g1.utilization_pct, g1.processes) == (None, None, [])
    server, hidden = g0.processes
    assert server == gpu.GpuProcess(
        4242, 0, 105840, "alice", "python -m sglang.launch_server --model-path /models/llama --tp 8", 4200,
        start="123460", group_start="123456",
    )
    # a pid nvidia-smi reports but /proc does not show (a container showing host pids)
    assert (hidden.pid, hidden.used_memory_mib, hidden.user, hidden.command, hidden.pgid) == (
        4243, None, None, None, None)


def test_parse_empty_compute_apps_and_cpu_host_and_driver_failure() -> None:
    doc = {"nvidia_smi": True, "gpus": [dict(zip(GPU_ROW, ("0", "GPU-a", "3", "81559", "0")))], "apps": [], "procs": {}}
    snap = gpu.parse_snapshot("h", doc)
    assert snap is not None and [g.processes for g in snap.gpus] == [[]]
    assert gpu.parse_snapshot("h", {"nvidia_smi": False}) is None
    with pytest.raises(OrchError, match="h: nvidia-smi failed: NVIDIA-SMI has failed"):
        gpu.parse_snapshot("h", {"nvidia_smi": True, "error": "NVIDIA-SMI has failed because it couldn't communicate"})


def test_stand_in_prints_the_real_formats(fake_gpus: FakeGpus, procs: list[subprocess.Popen]) -> None:
    p = foreign(procs, "sleep", "300")
    fake_gpus.add(p.pid, 1, 2000)
    fake_gpus.set_gpu(0, na=["utilization.gpu"])
    run = lambda *a: subprocess.run(["nvidia-smi", *a], capture_output=True, text=True, check=False)
    out = run("--query-gpu=index,uuid,memory.used,memory.total,utilization.gpu", "--format=csv,noheader,nounits")
    assert out.stdout.splitlines() == [
        "0, GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90, 3, 143771, [N/A]",
        "1, GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e91, 2003, 143771, 0",
    ]
    apps = ("--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits")
    assert run(*apps).stdout == f"{p.pid}, GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e91, 2000\n"
    p.kill()
    p.wait()
    assert run(*apps).stdout == ""  # dead: nothing at all, as the real tool prints
    bad = run("--bogus")
    assert bad.returncode == 2 and "Invalid combination of input arguments" in bad.stdout


def test_snapshot_of_real_processes(fake_gpus: FakeGpus, procs: list[subprocess.Popen], tmp_path: Path) -> None:
    p = foreign(procs, "sleep", "301")
    fake_gpus.add(p.pid, 1, 5000)
    snap = gpu.snapshot(connect(local_host(tmp_path)))
    assert snap is not None and [g.index for g in snap.gpus] == [0, 1]
    (proc,) = snap.gpus[1].processes
    assert (proc.pid, proc.gpu_index, proc.used_memory_mib, proc.command) == (p.pid, 1, 5000, "sleep 301")
    assert proc.pgid == os.getpgid(p.pid) and proc.user and proc.start
    assert snap.gpus[1].memory_used_mib == 5003
    assert gpu.snapshot_to_dict(snap)["gpus"][1]["processes"][0]["pid"] == p.pid
    text = "\n".join("\t".join(row) for row in gpu.table_rows({"local": snap, "cpu1": None, "gone": OrchError("down")}))
    assert "sleep 301" in text and "5003 / 143771" in text and "CPU host" in text and "error: down" in text


def test_snapshot_without_nvidia_smi(no_nvidia_smi: None, tmp_path: Path) -> None:
    assert gpu.snapshot(connect(local_host(tmp_path))) is None


def running_run(store: Store, pid: int, pid_start: str, host: str = "local") -> int:
    run_id = store.create_run("test", host, {})
    for to in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, to)
    transition(store, run_id, Status.RUNNING, pid=pid, pid_start=pid_start)
    return run_id


def test_attribute_by_process_group_and_start_time(fake_gpus: FakeGpus, ws: Workspace, store: Store,
                                                   procs: list[subprocess.Popen], orch_jobs: OrchJobs) -> None:
    run_id, wrapper, job = orch_jobs.start("exec sleep 300")
    # a run recorded with the same pid but another start time: the pid was reused, not its process
    running_run(store, wrapper, "1")
    # a process group orch did not start, under a run whose start time does not match
    leader = foreign(procs, "setsid", "sleep", "306")
    wait_for(lambda: os.getpgid(leader.pid) == leader.pid)
    impostor = running_run(store, leader.pid, "1")
    fake_gpus.add(job, 0)
    fake_gpus.add(leader.pid, 1)
    transport = connect(local_host(ws.root))
    snap = gpu.attribute(gpu.snapshot(transport), store, "local")
    assert snap.gpus[0].processes[0].run_id == run_id
    assert snap.gpus[1].processes[0].run_id is None
    elsewhere = gpu.attribute(gpu.snapshot(transport), store, "gpu01")
    assert [p.run_id for p in elsewhere.processes()] == [None, None]
    text = "\n".join("\t".join(row) for row in gpu.table_rows({"local": snap}))
    assert f"[run {run_id}] sleep 300" in text and "sleep 306" in text
    assert store.get_run(impostor).status == "running"
    (by_host,) = gpu.snapshots([local_host(ws.root)], store).values()  # what `orch gpus` shows
    assert isinstance(by_host, gpu.GpuSnapshot) and by_host.gpus[0].processes[0].run_id == run_id


def test_a_leaderless_group_is_the_runs_only_with_its_mark(fake_gpus: FakeGpus, ws: Workspace, store: Store,
                                                          procs: list[subprocess.Popen]) -> None:
    """A group whose leader is gone and that took the id of a run's wrapper (a recycled group): its members
    started after the wrapper, yet they are not the run's unless they carry its ORCH_JOB mark."""
    env = {k: v for k, v in os.environ.items() if k != launch.JOB_MARK}
    leader = subprocess.Popen(["setsid", "sh", "-c", "sleep 307 & sleep 308 & echo ready; exec sleep 0.5"],
                              stdout=subprocess.PIPE, text=True, env=env)
    procs.append(leader)
    assert leader.stdout is not None and leader.stdout.readline() == "ready\n"
    start = Path(f"/proc/{leader.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    run_id = running_run(store, leader.pid, start)
    leader.wait()
    members = [int(p) for p in subprocess.run(["pgrep", "-g", str(leader.pid)], capture_output=True, text=True,
                                              check=True).stdout.split()]
    assert len(members) == 2
    try:
        unmarked = members[0]
        fake_gpus.add(unmarked, 0)
        snap = gpu.attribute(gpu.snapshot(connect(local_host(ws.root))), store, "local")
        assert [p.run_id for p in snap.processes()] == [None]  # foreign: never killed as a leftover
        events: list[str] = []
        from orchestrator.runflow import cleanup
        cleanup._kill_leftovers(connect(local_host(ws.root)), store.get_run(run_id), snap.processes(),
                                lambda kind, message, data: events.append(message), 0.2)
        assert alive(unmarked) and events == []
    finally:
        for pid in members:
            os.kill(pid, signal.SIGKILL)


# --- cleanup before a launch -----------------------------------------------------------------------


def test_stale_orch_run_is_stopped_and_cancelled(fake_gpus: FakeGpus, ws: Workspace, store: Store,
                                                 orch_jobs: OrchJobs) -> None:
    stale, wrapper, job = orch_jobs.start("exec sleep 300")
    fake_gpus.add(job, 1, 70000)
    run = context(ws, store, FastSpec())
    clean(run, sleep=NO_SLEEP)
    assert not alive(job) and not alive(wrapper)  # gone before cleanup returned
    record = store.get_run(stale)
    assert record.status == "cancelled"
    assert record.reason == f"stopped by run {run.run_id} to free GPUs 0,1"
    messages = [e["message"] for e in gpu_events(store, run.run_id)]
    assert messages[0] == "before cleanup of GPUs 0,1" and messages[-1] == "GPUs 0,1 free"
    assert any(m.startswith(f"stopped run {stale} (stopped)") for m in messages)
    before = gpu_events(store, run.run_id)[0]["data"]
    assert before["gpus"][1]["processes"][0]["run_id"] == stale
    assert gpu_events(store, run.run_id)[-1]["data"]["gpus"][1]["processes"] == []
    assert run.env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_stale_run_that_ignores_sigterm_is_killed(fake_gpus: FakeGpus, ws: Workspace, store: Store,
                                                  orch_jobs: OrchJobs) -> None:
    stale, _, job = orch_jobs.start("trap '' TERM\nwhile true; do sleep 0.1; done")
    fake_gpus.add(job, 0)
    run = context(ws, store, FastSpec())
    clean(run, sleep=NO_SLEEP)
    assert not alive(job)
    assert store.get_run(stale).status == "cancelled"
    assert any(e["message"].startswith(f"stopped run {stale} (killed)") for e in gpu_events(store, run.run_id))


def test_foreign_process_blocks_and_survives(fake_gpus: FakeGpus, ws: Workspace, store: Store,
                                             procs: list[subprocess.Popen]) -> None:
    p = foreign(procs, "sleep", "302")
    fake_gpus.add(p.pid, 1)
    run = context(ws, store, FastSpec())
    with pytest.raises(OrchError) as err:
        clean(run, sleep=NO_SLEEP)
    message = str(err.value)
    assert "\n" not in message
    assert f"pid {p.pid} (sleep 302) on GPU 1" in message and "kill_foreign" in message
    time.sleep(0.2)
    assert p.poll() is None and alive(p.pid)
    assert "CUDA_VISIBLE_DEVICES" not in run.env
    assert gpu_events(store, run.run_id)[0]["message"] == "before cleanup of GPUs 0,1"


def test_foreign_process_on_other_gpus_is_left_alone(fake_gpus: FakeGpus, ws: Workspace, store: Store,
                                                     procs: list[subprocess.Popen]) -> None:
    p = foreign(procs, "sleep", "303")
    fake_gpus.add(p.pid, 0)
    run = context(ws, store, FastSpec(gpus=[1]))
    clean(run, sleep=NO_SLEEP)
    assert run.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert p.poll() is None


def test_kill_foreign(fake_gpus: FakeGpus, ws: Workspace, store: Store, procs: list[subprocess.Popen]) -> None:
    p = foreign(procs, "sleep", "304")
    fake_gpus.add(p.pid, 1)
    run = context(ws, store, FastSpec(kill_foreign=True))
    clean(run, sleep=NO_SLEEP)
    assert p.wait(timeout=5) == -signal.SIGTERM
    assert any(e["message"].startswith("killed foreign processes (stopped)") for e in gpu_events(store, run.run_id))


def test_kill_foreign_that_ignores_sigterm(fake_gpus: FakeGpus, ws: Workspace, store: Store,
                                           procs: list[subprocess.Popen]) -> None:
    p = foreign(procs, "bash", "-c", "trap '' TERM; while true; do sleep 0.1; done")
    time.sleep(0.2)  # let bash install the trap
    fake_gpus.add(p.pid, 0)
    run = context(ws, store, FastSpec(kill_foreign=True))
    clean(run, sleep=NO_SLEEP)
    assert p.wait(timeout=5) == -signal.SIGKILL


def test_gpus_that_never_free_up_fail_at_the_timeout(fake_gpus: FakeGpus, ws: Workspace, store: Store,
                                                    procs: list[subprocess.Popen]) -> None:
    p = foreign(procs, "sleep", "305")
    fake_gpus.add(p.pid, 1)
    fake_gpus.set_gpu(1, base_memory=30000)  # memory a dead process left behind
    slept: list[float] = []
    run = context(ws, store, FastSpec(kill_foreign=True, cleanup_timeout_s=5))
    with pytest.raises(OrchError) as err:
        clean(run, sleep=slept.append)
    assert str(err.value) == "GPU 1 still busy after 5 s: GPU 1: 30000 MiB in use and no process listed"
    assert sum(slept) >= 5 and slept[0] == pytest.approx(0.5)
    assert p.wait(timeout=5) == -signal.SIGTERM
    assert "CUDA_VISIBLE_DEVICES" not in run.env


def test_unknown_gpu_in_spec(fake_gpus: FakeGpus, ws: Workspace, store: Store) -> None:
    with pytest.raises(OrchError, match=r"no GPU 5 on this host \(it has 0,1\)"):
        clean(context(ws, store, FastSpec(gpus=[1, 5])), sleep=NO_SLEEP)


def test_cpu_host(no_nvidia_smi: None, ws: Workspace, store: Store) -> None:
    run = context(ws, store, FastSpec())
    clean(run, sleep=NO_SLEEP)
    assert [e["message"] for e in gpu_events(store, run.run_id)] == ["no nvidia-smi: CPU host"]
    assert "CUDA_VISIBLE_DEVICES" not in run.env


def test_cuda_visible_devices_follow_spec_gpus(fake_gpus: FakeGpus, ws: Workspace, store: Store) -> None:
    fake_gpus.state["gpus"] = FakeGpus(fake_gpus.path.with_name("four.json"), 4).state["gpus"]
    fake_gpus.save()
    run = context(ws, store, FastSpec(gpus=[3, 1]))
    clean(run, sleep=NO_SLEEP)
    assert run.env["CUDA_VISIBLE_DEVICES"] == "3,1"
    run = context(ws, store, FastSpec())
    clean(run, sleep=NO_SLEEP)
    assert run.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_a_run_stopped_by_cleanup_ends_like_any_run(fake_gpus: FakeGpus, ws: Workspace, store: Store,
                                                    engine: Any) -> None:
    """Its log tail is fetched, its patch set reverted byte for byte, its notification sent."""
    from test_notify import Receiver

    from orchestrator.runflow import notify
    from playbooks.command import CommandSpec

    receiver = Receiver()
    before = engine.snapshot("sglang")
    host = local_host(ws.root, {"python": engine.python})
    flags = "--cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled"
    spec = CommandSpec(cmd=f"echo serving {flags} ; exec sleep 300", patches=["sglang-eagle3-hidden-debug"],
                       notify=[receiver.url], cleanup=False, poll_min=0.05, poll_max=0.2)
    stale = runflow.start(ws, store, registry.playbook("command"), spec, host)
    assert engine.snapshot("sglang") != before  # applied
    fake_gpus.add(int(stale.run.pid or 0), 0)
    try:
        clean(context(ws, store, FastSpec()), sleep=NO_SLEEP)
        notify.drain(5)
        run = stale.refresh()
        assert run.status == "cancelled" and run.end_steps == list(runflow.END_STEPS)
        assert "serving" in (ws.run_dir(stale.run_id) / "log.tail").read_text()
        assert engine.snapshot("sglang") == before
        assert [(b["run_id"], b["status"]) for b in receiver.bodies] == [(stale.run_id, "cancelled")]
    finally:
        receiver.close()
