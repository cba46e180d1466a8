"""Faults on the host side, with real parts: real sshd on loopback, real processes, pids recycled on
purpose (ns_last_pid), a full disk (a tmpfs), rotated logs, a database locked or read-only."""

from __future__ import annotations

import os
import shlex
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from orchtest import FAST, JOB, TESTS, Orch, alive, job_cmd

from orchestrator import runflow
from orchestrator.config.hosts import Host
from orchestrator.config.workspace import Workspace
from orchestrator.runflow import registry
from orchestrator.store import Store
from orchestrator.watch import follow

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def wait_for(predicate, timeout: float = 20, step: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(step)


def recycle(pid: int, timeout: float = 10) -> subprocess.Popen:
    """A new process with exactly this pid, leading a process group of its own (as a pid recycled by an
    init that reaps at once would be): ns_last_pid makes the kernel hand it out next."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        NS_LAST_PID.write_text(str(pid - 1))
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()  # another fork took it first: try again
        proc.wait()
    raise AssertionError(f"pid {pid} could not be recycled")


# --- 4: identity proved before every signal ----------------------------------------------------------


# A scenario runs as a process of its own that reaps orphans at once, as tini or systemd do (this machine's
# init reaps late, so a dead pid would linger as a zombie and never be recycled in time).
REAPER = """
import ctypes, os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_faults import alive, recycle, wait_for
from orchestrator.host import launch
from orchestrator.config.hosts import local_host
from orchestrator.host.launch import HostExecutor, RunPaths
from orchestrator.host.remote import connect

ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the job's processes are reaped here


def reap():
    while True:
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED)
        except ChildProcessError:
            time.sleep(0.001)


threading.Thread(target=reap, daemon=True).start()
"""
RECYCLE_SCENARIO = REAPER + """
root = Path(sys.argv[1])
transport = connect(local_host(root))
# the job ignores SIGTERM (its wrapper does not): the group outlives its leader into the grace window.
# The launch returns once the wrapper runs, maybe before the job's shell set its trap: the kill waits
# for the job's word that it did, else SIGTERM could end the whole group at once.
host_jobs = HostExecutor(transport)
job = host_jobs.launch(RunPaths(str(root / "run")), launch.job_script("trap '' TERM; : > trapped; sleep 300", {}),
                       "t4")
pid = job.id
wait_for(lambda: (root / "run" / "trapped").exists())
outcome = []
killer = threading.Thread(target=lambda: outcome.append(host_jobs.kill(job, grace_s=4)))
killer.start()
wait_for(lambda: not Path(f"/proc/{pid}").exists(), step=0.001)  # SIGTERM ended the wrapper; its job lingers
try:
    os.killpg(pid, signal.SIGKILL)  # the job ends too, and the group's id is free again: recycled at once
except ProcessLookupError:
    pass  # nothing of the group left (the grace ran out: the killer's SIGKILL, and its outcome says so)
stranger = recycle(pid)
killer.join(timeout=30)
print(outcome[0], "survived" if alive(stranger.pid) else "signalled")
stranger.kill()
"""


@pytest.mark.skipif(not os.access(NS_LAST_PID, os.W_OK), reason="needs to write ns_last_pid (root)")
def test_a_pid_recycled_in_the_grace_window_is_never_signalled(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-c", RECYCLE_SCENARIO, str(tmp_path), str(TESTS)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    outcome, stranger = res.stdout.split()
    # 'killed' where the grace ran out before the job's group was gone (a loaded machine): the SIGKILL
    # went to the job's own group, never to the stranger
    assert outcome in ("stopped", "killed") and stranger == "survived"


# The narrowest window of all, made certain: the job's pid is proved, then, before the signal, the whole
# group ends and is reaped and the pid goes to a stranger. The signal goes through a hold taken before the
# proof, so it reaches nothing.
RACE_SCENARIO = REAPER + """
from orchestrator.host.hostjobs import jobs, procs
if sys.argv[3] == "older":  # a flag the kernel does not know is refused, as the group flag is before Linux 6.9
    procs.PIDFD_SIGNAL_PROCESS_GROUP = 1 << 30
if sys.argv[4] == "libc":  # as on Python 3.8: the system calls through libc
    del os.pidfd_open, signal.pidfd_send_signal
root = Path(sys.argv[1])
job = jobs.launch(str(root / "run"), launch.job_script(": > trapped; sleep 300", {}), "t5")
pid, start = int(job["pid"]), job["start"]
wait_for(lambda: (root / "run" / "trapped").exists())
strangers = []
proved = procs.start_time


def proof_then_recycle(p):
    now = proved(p)
    if p == pid and now == start and not strangers:
        os.killpg(pid, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), step=0.001)
        strangers.append(recycle(pid))
    return now


procs.start_time = proof_then_recycle
sent = procs.signal_job(pid, start, signal.SIGTERM)
print("sent" if sent else "nothing", "survived" if alive(strangers[0].pid) else "signalled")
strangers[0].kill()
"""


@pytest.mark.skipif(not os.access(NS_LAST_PID, os.W_OK), reason="needs to write ns_last_pid (root)")
@pytest.mark.parametrize(("kernel", "calls"), [("6.9 or newer", "python"), ("older", "python"), ("older", "libc")])
def test_a_pid_recycled_between_its_proof_and_the_signal_is_never_signalled(tmp_path: Path, kernel: str,
                                                                            calls: str) -> None:
    res = subprocess.run([sys.executable, "-c", RACE_SCENARIO, str(tmp_path), str(TESTS), kernel, calls],
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["nothing", "survived"]


# --- 10: the wrapper dies, its job runs on -----------------------------------------------------------


def test_a_dead_wrapper_leaves_the_run_running_and_cancel_stops_its_group(orch: Orch) -> None:
    res = orch("run", "command", "--host", "test1", "--detach", "--set", "cmd=sleep 300 & echo $! > child; wait",
               *FAST, check=0)
    run_id = int(res.stdout)
    run_dir = Path(orch.status(run_id)["remote_dir"])
    wait_for(lambda: (run_dir / "child").exists() and (run_dir / "child").read_text().strip())
    child = int((run_dir / "child").read_text())
    wrapper = int((run_dir / ".orch" / "pid").read_text().split()[0])
    os.kill(wrapper, signal.SIGKILL)  # only the wrapper
    wait_for(lambda: not alive(wrapper))
    orch("status", "--refresh", str(run_id), check=0)
    doc = orch.status(run_id)
    assert doc["status"] == "running" and alive(child)
    assert any(e["kind"] == "wrapper" for e in doc["events"])
    # its lease still holds the host: the GPUs are still in use
    busy = orch("run", "command", "--host", "test1", "--set", "cmd=true", *FAST)
    assert busy.returncode == 1 and f"busy with run {run_id}" in busy.stderr
    res = orch("cancel", str(run_id), "--grace", "2")
    assert res.returncode == 0, res.stderr
    wait_for(lambda: not alive(child), timeout=10)
    assert orch.status(run_id)["status"] == "cancelled"


# --- 8: a database locked past its busy timeout, or read-only ----------------------------------------


def test_a_database_locked_past_its_busy_timeout_leaves_the_run_watched(tmp_path: Path, ssh_fleet) -> None:
    ws = Workspace(root=tmp_path / "ws", hosts_file=tmp_path / "ws" / "hosts.toml")
    store = Store(ws.db_path, busy_timeout_s=0.3)
    host = Host(name="test1", **ssh_fleet.host_entry(1, workdir=str(tmp_path / "remote")))
    pb = registry.playbook("command")
    job = " ".join(shlex.quote(a) for a in (sys.executable, str(JOB), "--steps", "30", "--sleep", "0.1"))
    run = runflow.start(ws, store, pb, pb.Spec(cmd=job, poll_min=0.05, poll_max=0.3), host)

    def hold_the_lock() -> None:  # another process's transaction, ten times longer than the busy timeout
        other = sqlite3.connect(ws.db_path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        time.sleep(3)
        other.execute("COMMIT")
        other.close()

    locker = threading.Thread(target=hold_the_lock)
    locker.start()
    record = follow.watch(run)
    locker.join()
    assert record.status == "succeeded" and record.progress and record.progress["done"] == 30
    events = store.events(run.run_id)
    assert any(e["kind"] == "database" and "nothing was lost" in e["message"] for e in events)
    assert [e["message"] for e in events if e["kind"] == "phase"].count("running") <= 1  # read once


@pytest.fixture
def read_only_runs(tmp_path: Path):
    """A workspace whose runs/ (the database's folder) is a read-only mount."""
    orch = Orch(tmp_path / "ws")
    runs = orch.root / "runs"
    runs.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(runs)], check=False)
    if mounted.returncode != 0:
        pytest.skip("needs mount (root)")
    try:
        # the database exists, with a run in it; made by a process of its own, which leaves no file open
        # there (a remount read-only waits for that)
        orch("run", "command", "--set", "cmd=true", check=0, new_process=True)
        # the host's watcher leaves a moment after its last run ended, its output file open until then
        wait_for(lambda: subprocess.run(["mount", "-o", "remount,ro", str(runs)],
                                        capture_output=True, check=False).returncode == 0, step=0.2)
        yield orch
    finally:
        subprocess.run(["umount", "-l", str(runs)], check=True)


@pytest.mark.parametrize("args", [["status"], ["run", "command", "--set", "cmd=true"]])
def test_a_read_only_database_is_one_line_at_once(read_only_runs: Orch, args: list[str]) -> None:
    res = read_only_runs(*args, timeout=60)  # at once: no retrying a database that cannot be written
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.startswith("orch: ") and "cannot be written" in res.stderr


# --- 15: a job script bigger than one command line ---------------------------------------------------


def test_a_job_script_of_300_kib_is_uploaded_and_runs(orch: Orch) -> None:
    body = "echo first\n" + "".join(f": line {i} {'x' * 90}\n" for i in range(3000)) + "echo last-line-ran\n"
    assert len(body) > 300 << 10
    spec = orch.root / "big.toml"
    spec.write_text(f"cmd = '''\n{body}'''\n")
    res = orch("run", "command", "--host", "test1", "-f", str(spec), *FAST)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "succeeded"
    assert "last-line-ran" in orch("logs", "1", "-n", "3", check=0).stdout
    run_dir = Path(doc["remote_dir"])
    assert body in (run_dir / "job.sh").read_text()
    assert [p.name for p in run_dir.parent.iterdir()] == ["1"]  # the upload was moved into place


# --- 17: log rotation by identity ---------------------------------------------------------------------

# How each kind rotates the run's log, and how the job writes it: through the wrapper's file descriptor
# (which follows the file wherever it is renamed), or by opening `log` anew for each line.
ROTATIONS = {
    "copytruncate": ("cp log log.1 && truncate -s 0 log", "echo"),
    "rename, then the job reopens": ("mv log log.1", "to_log"),
    "rename, create; the job keeps its file": ("mv log log.1 && : > log", "echo"),
}


@pytest.mark.parametrize("kind", sorted(ROTATIONS))
def test_a_rotated_log_loses_no_line(orch: Orch, tmp_path: Path, kind: str) -> None:
    rotate, write = ROTATIONS[kind]
    marker, go = tmp_path / "rotate-now", tmp_path / "go-on"
    cmd = (f"to_log() {{ echo \"$@\" >> log; }}\n"
           f"for i in $(seq 1 40); do {write} \"orch-metric n=$i\"; done\n"
           f"touch {marker}; while [ ! -e {go} ]; do sleep 0.02; done\n"
           f"for i in $(seq 41 80); do {write} \"orch-metric n=$i\"; done\n")
    spec = orch.root / "rot.toml"
    spec.write_text(f"cmd = '''\n{cmd}'''\npoll_min = 2\npoll_max = 2\n")
    proc = orch.spawn("run", "command", "--host", "test1", "-f", str(spec))
    try:
        wait_for(marker.exists)
        wait_for(lambda: orch.status(1)["metrics"].get("n") == 40)  # the watcher has read to here
        run_dir = Path(orch.status(1)["remote_dir"])
        subprocess.run(["bash", "-c", rotate], cwd=run_dir, check=True)
        go.touch()
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
    doc = orch.status(1)
    assert doc["status"] == "succeeded"
    # every sample in order: no command prints a metric's whole series (status gives its summary)
    series = sqlite3.connect(orch.db).execute(
        "SELECT value FROM metrics WHERE run_id = 1 AND name = 'n' ORDER BY id").fetchall()
    assert [int(v) for (v,) in series] == list(range(1, 81))  # every line, once, in order


# --- 18: what the host can say of a job gone without an exit code ------------------------------------


@pytest.fixture
def full_disk(tmp_path: Path):
    """A 1 MiB tmpfs, to be the host's workdir."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], check=False)
    if mounted.returncode != 0:
        pytest.skip("needs mount (root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_full_disk_is_named_not_taken_for_the_oom_killer(tmp_path: Path, ssh_fleet, full_disk: Path) -> None:
    orch = Orch(tmp_path / "ws", ssh_fleet.hosts_toml(test1={"workdir": str(full_disk)}))
    res = orch("run", "command", "--host", "test1", "--set", "cmd=head -c 4M /dev/zero > fill; true", *FAST)
    assert res.returncode == 1
    doc = orch.status(1)
    assert doc["status"] == "lost" and "disk" in doc["reason"] and "is full" in doc["reason"]
    assert "OOM" not in doc["reason"]


def test_a_sigkill_without_an_oom_line_is_not_called_oom(orch: Orch) -> None:
    res = orch("run", "command", "--host", "test1", "--detach", "--set", "cmd=sleep 300", *FAST, check=0)
    run_id = int(res.stdout)
    run_dir = Path(orch.status(run_id)["remote_dir"])
    wrapper = int((run_dir / ".orch" / "pid").read_text().split()[0])
    os.killpg(wrapper, signal.SIGKILL)  # everything, by hand
    assert orch("watch", str(run_id)).returncode == 1
    doc = orch.status(run_id)
    assert doc["status"] == "lost" and "SIGKILL" in doc["reason"] and "OOM" not in doc["reason"]


# --- 19: orch's control files out of the job's way ------------------------------------------------------
def test_a_job_writing_exit_code_and_pid_in_its_dir_does_not_end_its_own_run(tmp_path: Path, ssh_fleet: Any) -> None:
    orch = Orch(tmp_path / "ws", ssh_fleet.hosts_toml(test1={"workdir": str(tmp_path / "r1")}))
    res = orch("run", "command", "--host", "test1", *FAST,
               "--set", "cmd=echo 0 > exit_code; echo 1 1 > pid; echo done > ended_at; sleep 1; exit 3")
    doc = orch.status(1)
    assert res.returncode == 1 and doc["status"] == "failed" and doc["exit_code"] == 3, (doc, res.stderr)
    run_dir = Path(doc["remote_dir"])
    assert (run_dir / "exit_code").read_text().strip() == "0"  # the job's own file, left as it wrote it
    assert (run_dir / ".orch" / "exit_code").read_text().strip() == "3"


# --- 22: two workspaces on one workdir ------------------------------------------------------------------
def test_two_workspaces_on_one_workdir_never_hold_the_same_gpus(tmp_path: Path, ssh_fleet: Any) -> None:
    shared = str(tmp_path / "shared-workdir")
    a = Orch(tmp_path / "ws-a", ssh_fleet.hosts_toml(test1={"workdir": shared}))
    b = Orch(tmp_path / "ws-b", ssh_fleet.hosts_toml(test1={"workdir": shared}))
    long_job = job_cmd("--steps", "600", "--sleep", "0.1")
    held = int(a("run", "command", "--host", "test1", "--detach", *FAST, "--set", "gpus=[0]", "--set", long_job,
                 check=0).stdout)
    # GPU 0 is a's, whatever b's database says: the host refuses, naming a's run, before b makes a run at all
    res = b("run", "command", "--host", "test1", *FAST, "--set", "gpus=[0]", "--set", "cmd=true")
    assert res.returncode == 1 and "GPUs 0 held by another workspace's run" in res.stderr, res.stderr
    said = res.stderr.replace("\n", "")  # as wrapped on a terminal
    assert f"{a.db}:{held}:" in said and a.status(held)["remote_dir"] in said, res.stderr
    assert b.status() == []  # nothing to remove or read later
    # GPU 1 is free; b's run 1 and a's run 1 have run dirs of their own (keyed by workspace)
    assert b("run", "command", "--host", "test1", *FAST, "--set", "gpus=[1]", "--set", "cmd=true").returncode == 0
    dirs = {a.status(held)["remote_dir"], b.status(1)["remote_dir"]}
    assert len(dirs) == 2 and all(d.startswith(shared + "/runs/") for d in dirs), dirs
    leases = Path(shared) / "leases"
    assert sorted(p.name for p in leases.iterdir() if not p.name.startswith(".")) == ["gpu-0"]  # b's freed
    a("cancel", str(held), "--grace", "1", check=0)
    a.wait_finished(held, timeout=60)
    assert not (leases / "gpu-0").exists()
    assert b("run", "command", "--host", "test1", *FAST, "--set", "gpus=[0]", "--set", "cmd=true").returncode == 0


def test_a_full_disk_on_the_controller_pauses_the_watcher_and_it_goes_on_when_space_returns(tmp_path: Path) -> None:
    """The workspace on a real 2 MiB tmpfs, mounted in a mount namespace of the test's own (a user namespace
    too when not root): the disk fills while a run is watched and its job ends; the host's watcher pauses
    saying why, and once space returns it records the rest and the end, nothing lost."""
    import json
    import shutil

    ws, hostdir = tmp_path / "ws", tmp_path / "host"
    ws.mkdir()
    hostdir.mkdir()
    namespace = (["unshare", "--mount", "--propagation", "private"] if os.geteuid() == 0 else
                 ["unshare", "--user", "--map-root-user", "--mount"])
    assert shutil.which("unshare")
    script = f'mount -t tmpfs -o size=2m tmpfs {shlex.quote(str(ws))} && exec "$@"'
    res = subprocess.run([*namespace, "sh", "-c", script, "sh", sys.executable, str(TESTS / "diskfull_scenario.py"),
                          str(ws), str(hostdir)], capture_output=True, text=True, timeout=180, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["during"] == {"status": "running", "watcher_alive": True}  # paused, not dead, no false end
    assert got["status"] == "succeeded" and got["last_line"] == "sample 200" and got["same_watcher"]
    assert got["end_steps"] == list(runflow.END_STEPS)
    paused = [m for k, m in got["events"] if k == "database"]
    assert paused and "disk" in paused[0] and "paused" in paused[0] and "nothing was lost" in paused[0]


def dark_host(link: Any, ssh_fleet: Any, tmp_path: Path) -> dict[str, Any]:
    """The hosts.toml entry of a DarkLink's sshd (tests/test_live.py), its host key known."""
    known = tmp_path / "known_hosts"
    known.write_text(link.server.host_key_line + "\n")
    return {"address": "198.18.0.2", "port": link.server.port, "user": ssh_fleet.user,
            "identity_file": str(ssh_fleet.client_key), "known_hosts": str(known),
            "workdir": str(tmp_path / "r-dark"), "python": sys.executable}

def test_cancel_on_a_dark_host_stays_cancelling_with_its_lease_until_the_host_answers_and_the_job_is_stopped(
        tmp_path: Path, ssh_fleet) -> None:
    """A real sshd in a network namespace whose link is cut: `orch cancel` says at once that the job is not
    stopped yet, the run stays `cancelling` holding its host (the job runs on over there); once the link is
    back its host's watcher stops the job, and only then is the run cancelled and the host free."""
    import json

    from test_live import DarkLink, event_time

    if os.geteuid() != 0:
        pytest.fail("network namespaces need root")
    link = DarkLink(tmp_path / "dark-sshd", ssh_fleet.authorized_keys)
    try:
        host = dark_host(link, ssh_fleet, tmp_path)
        orch = Orch(tmp_path / "ws", "[hosts.dark]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in host.items()))
        res = orch("run", "command", "--host", "dark", "--detach", "--set", "poll_min=1", "--set", "poll_max=5",
                   "--set", job_cmd("--steps", "600", "--sleep", "0.5"), check=0)
        run_id = int(res.stdout)
        pid = orch.wait_for(run_id, lambda d: d["progress"] is not None and d["pid"], timeout=60)["pid"]
        link.link(False)
        orch.wait_for(run_id, lambda d: event_time(d, "unreachable", "") is not None, timeout=60)
        res = orch("cancel", str(run_id), "--grace", "1", check=0)
        assert "cancelling: not stopped yet: host dark does not answer" in res.stderr  # said, not waited out
        doc = orch.status(run_id)
        assert doc["status"] == "cancelling" and alive(pid)  # no false end: the job runs on over there
        busy = orch("run", "command", "--host", "dark", "--set", "cmd=true", *FAST)
        assert busy.returncode != 0 and f"busy with run {run_id} (command, cancelling" in busy.stderr  # held
        link.link(True)
        doc = orch.wait_for(run_id, lambda d: d["status"] == "cancelled" and any(
            e["kind"] == "stopped" for e in d["events"]), timeout=120)  # its watcher stopped it
        assert doc["reason"] == "cancelled by user" and not alive(pid)
        again = orch("run", "command", "--host", "dark", "--set", "cmd=true", *FAST, check=0)
        assert again.returncode == 0, again.stderr  # the host is free once the job is stopped
    finally:
        link.close()


def test_a_multi_node_runs_end_leaves_a_node_on_a_dark_host_cancelling_until_it_answers(
        tmp_path: Path, ssh_fleet) -> None:
    """The head's end stops every node; a node whose host's link is cut stays `cancelling`, holding that
    host, and the head's end does not wait on it; once the link is back the node is stopped and cancelled."""
    import json

    from test_live import DarkLink

    if os.geteuid() != 0:
        pytest.fail("network namespaces need root")
    link = DarkLink(tmp_path / "dark-sshd", ssh_fleet.authorized_keys)
    try:
        dark = dark_host(link, ssh_fleet, tmp_path)
        hosts = ssh_fleet.hosts_toml(test1={"workdir": str(tmp_path / "r1")})
        orch = Orch(tmp_path / "ws", hosts + "[hosts.dark]\n" + "".join(f"{k} = {json.dumps(v)}\n"
                                                                         for k, v in dark.items()))
        res = orch("run", "command", "--host", "test1", "--host", "dark", "--detach", "--set", "poll_min=1",
                   "--set", "poll_max=5", "--set", "cmd=sleep 300", check=0)
        assert res.returncode == 0, res.stderr
        pids = [orch.wait_for(i, lambda d: d["status"] == "running" and d["pid"], timeout=60)["pid"] for i in (1, 2)]
        link.link(False)
        orch("cancel", "1", "--grace", "1", check=0)  # (the node's stop is tried: no route to its host)
        head, node = orch.status(1), orch.status(2)
        assert head["status"] == "cancelled" and not alive(pids[0])
        assert node["status"] == "cancelling" and alive(pids[1])  # no false end: it runs on over there
        busy = orch("run", "command", "--host", "dark", "--set", "cmd=true", *FAST)
        assert busy.returncode != 0 and "busy with run" in busy.stderr  # the dark host stays held
        link.link(True)
        node = orch.wait_for(2, lambda d: d["status"] == "cancelled" and any(
            e["kind"] == "stopped" for e in d["events"]), timeout=120)
        assert not alive(pids[1])
    finally:
        link.close()
