"""Runs on a real one-node Slurm cluster with 8 fake GPUs (tests/slurmcluster.py): sbatch, squeue,
scancel and the scheduler's own ends, through the real `orch` CLI."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from orchtest import Orch, kill_controller, wait_for_file
from slurmcluster import SlurmCluster, free_port, missing, running

from orchestrator.config.hosts import Host
from orchestrator.host import slurm
from orchestrator.host.hostjobs import slurm as host_slurm
from orchestrator.host.launch import RunPaths
from orchestrator.host.polling import queue_query_s
from orchestrator.host.remote import LocalTransport
from orchestrator.store import Store, lease

pytest_plugins = ["engine_src"]  # engine: real sglang 0.5.23 source

POLL = ["--set", "poll_min=0.05", "--set", "poll_max=0.3"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = missing()
    if why:
        pytest.skip(why)
    # 8 CPUs declared, more than this machine may have: the job over its time limit (below) holds one all along
    with running(SlurmCluster(tmp_path_factory.mktemp("slurm"), gpus=8, cpus=8)) as c:  # orch (and its sbatch/squeue) find this cluster, never /etc/slurm
        yield c


def cluster_toml(shared: Path, gpus: int = 8, **fields: str) -> str:
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
    return (f"[hosts.cluster]\nscheduler = \"slurm\"\ngpus = {gpus}\nworkdir = {json.dumps(str(shared))}\n"
            f"python = {json.dumps(sys.executable)}\npoll_min = 0.3\npoll_max = 1\n{extra}")


@dataclass
class OverTime:
    """A run whose Slurm job outlives its time limit, started before this file's first test (Slurm's limits are
    whole minutes, checked every 30 s: it ends 60-90 s later, while the other tests run), and checked by the
    file's last test. It asks for no GPU, so the others find the node's GPUs free."""

    orch: Orch
    proc: subprocess.Popen
    job_id: int


@pytest.fixture(scope="module", autouse=True)
def over_time(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OverTime]:
    from orchtest import stop_background_watchers

    root = tmp_path_factory.mktemp("over-time")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(root))  # its watcher outlives any one test's HOME
        o = Orch(root / "ws", cluster_toml(root / "shared", gpus=0, time_limit="1"))
        proc = o.spawn("run", "command", "--host", "cluster", "--set", "cmd=echo started; sleep 600", *POLL)
        try:
            deadline = time.time() + 60
            while not (o.db.exists() and any(r["job_id"] for r in o.status())):
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                assert time.time() < deadline, "the run's job got no Slurm job id within 60 s"
                time.sleep(0.1)
            yield OverTime(o, proc, int(o.status(1)["job_id"]))
        finally:
            if proc.poll() is None:
                proc.kill()
            stop_background_watchers(root)


@pytest.fixture
def orch_hosts(tmp_path: Path, cluster: SlurmCluster, over_time: OverTime) -> Iterator[str]:
    yield cluster_toml(tmp_path / "shared")
    cluster.cancel_all(spare={over_time.job_id})  # nothing of one test is left holding the node's GPUs for the next


def squeue(cluster: SlurmCluster, job_id: int, fmt: str = "%T") -> str:
    return cluster.client("squeue", "-h", "-t", "all", "-j", str(job_id), "-o", fmt).stdout.strip()


def test_command_job_through_sbatch_gets_the_gpus_it_asked_for(orch, cluster):
    res = orch("run", "command", "--host", "cluster", "--set", "cmd=echo \"CVD=$CUDA_VISIBLE_DEVICES\"",
               "--set", "gpus=[0,1,2]", *POLL)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "succeeded" and doc["exit_code"] == 0
    job_id = doc["job_id"]
    assert job_id and doc["node"] == "localhost" and doc["pid"] is None  # a Slurm job is no process of the host
    assert squeue(cluster, job_id, "%j %T") == "orch-1 COMPLETED"
    visible = orch("logs", "1", check=0).stdout.strip().removeprefix("CVD=").split(",")
    assert len(visible) == 3  # --gres=gpu:3: three of the node's eight, whichever Slurm chose
    messages = [e["message"] for e in doc["events"]]
    # submitted, it waits in the queue as a status of its own; it runs from the job's own start on its node
    assert f"queued: Slurm job {job_id} on cluster" in messages and "running: left the queue (localhost)" in messages
    began = float((Path(doc["remote_dir"]) / ".orch" / "started_at").read_text())
    assert doc["started_at"] == began and doc["created_at"] < began
    assert not [e for e in doc["events"] if e["kind"] == "gpu"]  # GPU cleanup is the scheduler's
    # the receipt's host part was looked at by the job on its node as it started (the submission only asked)
    receipt = doc["receipt"]
    assert receipt["node"] == "localhost" and receipt["hostname"] == socket.gethostname()
    assert receipt["hardware"]["cpu"]["count"] >= 1 and receipt["engine"]["python_version"] == sys.version.split()[0]


def test_extract_hidden_states_through_sbatch(orch, cluster):
    res = orch("run", "extract-hidden-states", "--host", "cluster", "--set", "max_samples=4",
               "--set", "layers=[1,2]", "--set", "gpus=[0]", *POLL, timeout=400)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "succeeded" and doc["job_id"] and doc["metrics"]["samples"] == 4
    manifest = json.loads((Path(doc["remote_dir"]) / "hidden_states" / "manifest.json").read_text())
    assert manifest["layers"] == [1, 2]
    assert squeue(cluster, doc["job_id"]) == "COMPLETED"


def test_a_job_waiting_for_gpus_is_queued_with_the_reason_then_runs(orch, cluster, tmp_path):
    release = tmp_path / "release"
    hold = f"cmd=while [ ! -e {release} ]; do sleep 0.1; done"
    assert orch("run", "command", "--host", "cluster", "--set", hold, "--detach", *POLL).returncode == 0
    waiting = orch.spawn("run", "command", "--host", "cluster", "--set", "cmd=echo ran on $CUDA_VISIBLE_DEVICES",
                         "--set", "gpus=[0,1]", *POLL)
    try:
        deadline = time.time() + 60
        while not any(r["id"] == 2 for r in orch.status()):  # `orch status 2` refuses a run not made yet
            assert time.time() < deadline and waiting.poll() is None
            time.sleep(0.1)
        # the reason is Slurm's latest: "None" or "Priority" right after submission, then "Resources"
        doc = orch.wait_for(2, lambda d: d["phase"] == "queued" and d["queue_reason"] == "Resources")
        # no host lease on a cluster: run 2 was submitted while run 1 holds every GPU, and waits in Slurm's queue
        assert lease.held(Store(orch.db)) == []  # leases: orch's own bookkeeping, shown by no command
        assert doc["status"] == "queued" and doc["queue_reason"] == "Resources"  # waiting is its own status
        assert squeue(cluster, doc["job_id"], "%T %r") == "PENDING Resources"
        table = orch("status", check=0).stdout
        assert "queued (Resources)" in table
        release.touch()
        assert waiting.wait(timeout=60) == 0, waiting.stderr.read() if waiting.stderr else ""
    finally:
        release.touch()
        if waiting.poll() is None:
            waiting.kill()
    doc = orch.status(2)
    assert doc["status"] == "succeeded" and doc["queue_reason"] is None and doc["phase"] == "finished"
    kinds = [e["kind"] for e in doc["events"]]
    assert kinds.index("queued") < kinds.index("node")


def test_cancel_uses_scancel(orch, cluster, tmp_path):
    started = tmp_path / "started"
    res = orch("run", "command", "--host", "cluster", "--set", f"cmd=touch {started}; sleep 600", "--detach", *POLL)
    assert res.returncode == 0, res.stderr
    wait_for_file(started)
    job_id = orch.status(1)["job_id"]
    res = orch("cancel", "1", "--grace", "8", check=0)
    assert "cancelled (stopped)" in res.stderr
    doc = orch.status(1)
    assert doc["status"] == "cancelled" and doc["reason"] == "cancelled by user"
    assert squeue(cluster, job_id) == "CANCELLED"
    left = subprocess.run(["pgrep", "-f", f"touch {started}; sleep 600"], capture_output=True, check=False)
    assert left.returncode == 1


def test_a_job_cancelled_in_slurm_ends_the_run_cancelled(orch, cluster, tmp_path):
    started = tmp_path / "started"
    proc = orch.spawn("run", "command", "--host", "cluster", "--set", f"cmd=touch {started}; sleep 600", *POLL)
    wait_for_file(started)
    cluster.client("scancel", str(orch.status(1)["job_id"]), check=True)
    assert proc.wait(timeout=60) == 1
    doc = orch.status(1)
    assert doc["status"] == "cancelled" and doc["reason"].startswith("CANCELLED: Slurm job")


def test_watch_finds_the_job_by_id_after_the_controller_was_killed(orch, cluster, tmp_path):
    started, release = tmp_path / "started", tmp_path / "release"
    cmd = f"cmd=touch {started}; while [ ! -e {release} ]; do sleep 0.1; done; echo done"
    proc = orch.spawn("run", "command", "--host", "cluster", "--set", cmd, *POLL)
    wait_for_file(started)
    kill_controller(proc)
    job_id = orch.status(1)["job_id"]
    assert squeue(cluster, job_id) == "RUNNING"  # the job outlives its controller
    release.touch()
    res = orch("watch", "1", timeout=120)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "succeeded" and doc["job_id"] == job_id
    assert "done" in (orch.root / "runs" / "1" / "log.tail").read_text()


def test_hostile_host_values_reach_sbatch_as_single_words(tmp_path, cluster, monkeypatch):
    """Every value from hosts.toml and the run dir is one argument of sbatch, never shell text."""
    shared = tmp_path / "a dir; $(touch pwned) `id`"
    pwned = Path("pwned")
    fields = {"partition": "debug", "account": "x$(touch pwned)", "qos": "a b; touch pwned",
              "time_limit": "5", "constraint": "'\"$HOME", "sbatch_args": ["--comment=$(touch pwned) ;|&"]}
    host = Host(name="cluster", scheduler="slurm", gpus=2, workdir=str(shared), **fields)
    paths = RunPaths.for_run(str(shared), 99)  # the runs below are 1
    # a stand-in sbatch first on PATH records its argv, NUL-separated, and prints a job id
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {tmp_path}/argv\necho 77\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    args = slurm.sbatch_args(host, paths, 2)
    with monkeypatch.context() as m:  # the stand-in for this call only: the runs below use the real one
        m.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
        assert host_slurm.submit(paths.root, "echo hi\n", "tok'en $(x)", args) == {"job_id": 77, "again": False}
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    # the batch script sits with the run's other control files
    assert argv == [*args, "--parsable", ".orch/batch.sh"]
    assert f"--chdir={paths.root}" in argv and "--account=x$(touch pwned)" in argv
    assert "--comment=$(touch pwned) ;|&" in argv and "--gres=gpu:2" in argv
    assert not (tmp_path / "pwned").exists() and not pwned.exists()
    # the real sbatch takes them verbatim (no accounting here: any account goes)...
    o = Orch(tmp_path / "ws", cluster_toml(shared, account="x$(touch pwned)"))
    with open(o.root / "hosts.toml", "a") as f:
        f.write('sbatch_args = ["--comment=$(touch pwned) ;|&"]\n')
    res = o("run", "command", "--host", "cluster", "--set", "cmd=echo ok", *POLL)
    assert res.returncode == 0, res.stderr
    assert squeue(cluster, o.status(1)["job_id"], "%a|%k") == "x$(touch pwned)|$(touch pwned) ;|&"
    # ...or refuses one it cannot parse, and the run fails before launch with sbatch's reason
    o2 = Orch(tmp_path / "ws2", cluster_toml(shared / "2", constraint="'\"$HOME"))
    res = o2("run", "command", "--host", "cluster", "--set", "cmd=touch ran", *POLL)
    assert res.returncode == 1 and "Invalid feature specification" in res.stderr
    assert o2.status(1)["status"] == "failed"
    assert not (tmp_path / "pwned").exists() and not pwned.exists() and not list(shared.rglob("pwned"))


def test_one_scheduler_query_serves_every_watcher_of_a_round(cluster, tmp_path):
    host = Host(name="cluster-q", scheduler="slurm", gpus=8, workdir=str(tmp_path), poll_min=3)
    transport = LocalTransport(host)
    ids = [cluster.client("sbatch", "--parsable", "-o", "/dev/null", "--wrap", "sleep 30", check=True).stdout.strip()
           for _ in range(6)]
    queue = slurm.Queue(transport, interval_s=queue_query_s(host))
    answers: dict[str, slurm.JobInfo | None] = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, queue.lookup(i))) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.1)
    assert all(answers[i] and answers[i].state in ("RUNNING", "PENDING") for i in ids)
    assert queue.calls == 1
    before = queue.calls
    for i in ids:
        queue.lookup(i)
    assert queue.calls == before  # the same round: no new query
    cluster.client("scancel", *ids)


def test_squeue_and_sacct_parsing_is_defensive():
    jobs = slurm.parse_squeue(host_slurm.squeue_rows(
        "12|PENDING||orch-3|Resources\n13|RUNNING|gpu[01-02]|orch-4|None\n"
        "garbage\n14|CANCELLED by 0|n1|orch-5|(null)\n15_3|COMPLETING+|n1|x|a|b\n"))
    assert jobs["12"].queued and jobs["12"].reason == "Resources" and jobs["12"].node is None
    assert jobs["13"].node == "gpu[01-02]" and not jobs["13"].ended
    assert jobs["14"].state == "CANCELLED" and jobs["14"].ended and jobs["14"].reason is None
    assert jobs["15_3"].state == "COMPLETING" and jobs["15_3"].reason == "a|b"
    acct = slurm.parse_sacct(host_slurm.sacct_rows("20|TIMEOUT|n1|orch-1|0:15\n21|COMPLETED|n2|orch-2|3:0\nJobID|State\n"))
    assert acct["20"].state == "TIMEOUT" and acct["20"].exit_code == 128 + 15 and acct["21"].exit_code == 3
    assert slurm.parse_job_id("4242;cluster\n") == 4242
    assert slurm._gpu_count("gpu:h100:4(S:0-1),gpu:a100:2,shard:8") == 6


def test_gpus_of_a_cluster_come_from_the_scheduler(orch, cluster, tmp_path):
    started = tmp_path / "started"
    res = orch("run", "command", "--host", "cluster", "--set", f"cmd=touch {started}; sleep 600",
               "--set", "gpus=[0,1,2]", "--detach", *POLL)
    assert res.returncode == 0, res.stderr
    wait_for_file(started)
    nodes = json.loads(orch("gpus", "--host", "cluster", "--json", check=0).stdout)["cluster"]["nodes"]
    assert nodes == [{"node": "localhost", "gpus": 8, "used": 3, "state": "mixed", "partitions": ["debug"]}]
    assert "localhost" in orch("gpus", "--host", "cluster", check=0).stdout


def test_a_sweep_with_max_parallel_never_runs_more_jobs_at_once_and_resumes_by_job_id(orch, cluster, tmp_path,
                                                                                      over_time):
    gates = tmp_path / "gates"  # each point's job runs until the test creates gates/<A><B>
    gates.mkdir()
    sweep_file = orch.root / "s.toml"
    sweep_file.write_text(f"""name = "grid"\nplaybook = "command"\nhosts = ["cluster"]\nmax_parallel = 2
[spec]\ncmd = "while [ ! -e {gates}/$A$B ]; do sleep 0.1; done; echo point $A$B"\ngpus = [0]
poll_min = 0.05\npoll_max = 0.3\n[matrix]\n"env.A" = ["x", "y"]\n"env.B" = ["1", "2", "3"]\n""")
    seen: list[int] = []  # the cluster's jobs not ended, sampled all along: none is submitted past the bound
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            out = cluster.client("squeue", "-h", "-t", "PENDING,RUNNING,CONFIGURING,COMPLETING", "-o", "%i").stdout
            seen.append(len(set(out.split()) - {str(over_time.job_id)}))
            time.sleep(0.1)

    def rows() -> list[dict]:
        res = orch("status", "--json", "--limit", "1000000")
        if res.returncode != 0:  # the database is still being created
            return []
        return sorted(json.loads(res.stdout), key=lambda r: r["id"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        proc = orch.spawn("sweep", "run", str(sweep_file))
        (gates / "x1").touch()  # the first point ends; the next two are submitted and held
        deadline = time.time() + 90
        while not (sum(r["status"] == "succeeded" for r in rows()) == 1
                   and sum(r["status"] == "running" and r["job_id"] is not None for r in rows()) == 2):
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
        kill_controller(proc)
        interrupted = {r["id"]: r["job_id"] for r in rows() if r["status"] == "running"}
        resumed = orch.spawn("sweep", "run", str(sweep_file))
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(resumed.stderr), daemon=True)
        reader.start()
        deadline = time.time() + 90  # the held jobs are found again before any is let go
        while not all(any(f"watching run {run_id} again" in line for line in said) for run_id in interrupted):
            assert time.time() < deadline and resumed.poll() is None, "".join(said)
            time.sleep(0.05)
        for point in ("x2", "x3", "y1", "y2", "y3"):
            (gates / point).touch()
        assert resumed.wait(timeout=180) == 0, "".join(said)
        reader.join(10)
    finally:
        done.set()
        sampler.join()
    final = rows()
    assert len(final) == 6 and all(r["status"] == "succeeded" for r in final)
    assert len({json.dumps(r["point"], sort_keys=True) for r in final}) == 6
    assert seen and max(seen) <= 2 and 2 in seen
    # the interrupted jobs were found again by their Slurm job ids and watched to their end
    for run_id, job_id in interrupted.items():
        assert next(r for r in final if r["id"] == run_id)["job_id"] == job_id
    # the jobs' own start and end times (one GPU each: Slurm alone would run all six at once): two at a time
    spans = [(r["started_at"], r["ended_at"]) for r in final]
    assert max(sum(s <= start < e for s, e in spans) for start, _ in spans) == 2


def test_a_patch_set_goes_to_the_runs_own_overlay_never_to_the_shared_install(tmp_path, cluster, engine):
    o = Orch(tmp_path / "ws", cluster_toml(tmp_path / "shared").replace(sys.executable, engine.python))
    before = engine.snapshot("sglang")
    # the top-level name only: importing sglang would need its dependencies
    where = "import importlib.util as u; print('found', u.find_spec('sglang').submodule_search_locations[0])"
    cmd = f"cmd={engine.python} -c \"{where}\" --cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled"
    res = o("run", "command", "--host", "cluster", "--set", cmd, "--set", 'patches=["sglang-eagle3-hidden-debug"]',
            *POLL)
    assert res.returncode == 0, res.stderr
    doc = o.status(1)
    assert doc["status"] == "succeeded" and doc["job_id"]
    overlay = Path(doc["remote_dir"]) / "overlay"
    patched = overlay / "sglang" / "srt" / "models" / "llama_eagle3.py"
    # the job imported the run's patched copy, first on its PYTHONPATH
    assert o("logs", "1", check=0).stdout.strip() == f"found {overlay / 'sglang'}"
    assert 'orch_eagle3_debug("draft.input_hidden", hidden_states)' in patched.read_text()
    # the install every other job uses never changed, and has nothing to revert
    assert engine.snapshot("sglang") == before
    events = [e["message"] for e in doc["events"] if e["kind"] == "patch"]
    assert len(events) == 1 and f"the run's copy in {overlay}" in events[0] and "applied" in events[0]
    assert "sglang-eagle3-hidden-debug" not in o("patch", "status", "--host", "cluster", "--json", check=0).stdout


def test_hosts_check_asks_the_scheduler_too(orch, cluster, tmp_path):
    res = orch("hosts", "--check", "--json", check=0)
    row = next(r for r in json.loads(res.stdout) if r["name"] == "cluster")
    assert row["ok"] and row["uname"] and row["scheduler"] == "slurm: debug* (1 nodes)"
    # a controller that does not answer: the host is not ok, with sinfo's reason
    conf = tmp_path / "slurm.conf"
    text = cluster.conf.read_text()
    conf.write_text("\n".join(f"SlurmctldPort={free_port()}" if line.startswith("SlurmctldPort") else line
                              for line in text.splitlines()) + "\n")
    assert "SlurmctldPort" in text
    orch.env["SLURM_CONF"] = str(conf)
    res = orch("hosts", "--check", "--json", "--timeout", "20")
    assert res.returncode == 1
    row = next(r for r in json.loads(res.stdout) if r["name"] == "cluster")
    assert not row["ok"] and "Unable to contact slurm controller" in row["error"]


def test_a_log_line_of_a_batch_job_is_recorded_as_it_comes_not_on_the_next_poll(orch, cluster, tmp_path):
    """The login node's agent follows the job's log on the shared filesystem and pushes it: with an hour
    between polls, a line the running job prints is recorded all the same (how soon: bench/cluster.py)."""
    go = tmp_path / "go"
    cmd = f"cmd=until [ -e {go} ]; do sleep 0.1; done; echo 'orch-metric tok_s=94.5'; sleep 60"
    res = orch("run", "command", "--host", "cluster", "--set", cmd, "--set", "poll_min=3600",
               "--set", "poll_max=3600", "--detach", check=0)
    run_id = int(res.stdout)
    # out of the queue (whose pace is quicker than the polls): from now on, only a push brings the line
    orch.wait_for(run_id, lambda d: d["status"] == "running", timeout=60)
    go.touch()
    doc = orch.wait_for(run_id, lambda d: d["metrics"].get("tok_s") == 94.5, timeout=60)
    assert doc["status"] == "running"
    orch("cancel", str(run_id), "--grace", "1", check=0)
    assert orch.wait_for(run_id, lambda d: d["status"] == "cancelled", timeout=60)


def test_a_run_dir_swapped_while_the_job_waits_in_the_queue_is_refused_when_it_starts(orch, cluster, tmp_path):
    """Someone else puts a folder of theirs in place of a queued job's run dir (the queue wait may be long):
    when the batch job starts, its wrapper finds the run dir no longer this user's and refuses to run
    anything, and nothing planted there (a `hashlib.py` in the folder the batch script starts in, a job
    script) runs."""
    release = tmp_path / "release"
    marker = tmp_path / "pwned"
    hold = f"cmd=while [ ! -e {release} ]; do sleep 0.1; done"
    assert orch("run", "command", "--host", "cluster", "--set", hold, "--detach", *POLL).returncode == 0
    waiting = orch.spawn("run", "command", "--host", "cluster", "--set", "cmd=echo ran", "--set", "gpus=[0,1]", *POLL)
    try:
        deadline = time.time() + 60
        while not any(r["id"] == 2 for r in orch.status()):
            assert time.time() < deadline and waiting.poll() is None
            time.sleep(0.1)
        doc = orch.wait_for(2, lambda d: d["phase"] == "queued" and d["queue_reason"] == "Resources")
        root = Path(doc["remote_dir"])
        root.rename(root.with_name(root.name + ".old"))
        (root / ".orch").mkdir(parents=True)
        (root / ".orch" / "token").write_text((root.with_name(root.name + ".old") / ".orch" / "token").read_text())
        (root / "hashlib.py").write_text(f"open({str(marker)!r}, 'w').write('module')\n")
        (root / "job.sh").write_text(f"echo script > {marker}\n")
        for path in (root, root / ".orch", root / ".orch" / "token", root / "hashlib.py", root / "job.sh"):
            os.chown(path, 61234, -1)  # another user's
        release.touch()
        waiting.wait(timeout=90)
    finally:
        release.touch()
        if waiting.poll() is None:
            waiting.kill()
    doc = orch.wait_for(2, lambda d: d["status"] not in ("queued", "running"), timeout=90)
    assert doc["status"] == "failed", doc
    assert not marker.exists(), marker.read_text()


def test_a_job_over_its_time_limit_ends_with_timeout(over_time, cluster):
    """Last in this file: its job was started with the file's first test."""
    assert over_time.proc.wait(timeout=200) == 1, over_time.proc.stderr.read() if over_time.proc.stderr else ""
    doc = over_time.orch.status(1)
    assert doc["status"] == "failed" and doc["phase"] == "failed"
    assert doc["reason"].startswith("TIMEOUT: Slurm job") and "time limit" in doc["reason"]
    assert doc["job_id"] == over_time.job_id and squeue(cluster, over_time.job_id) == "TIMEOUT"
