"""Faults on the host side, with real parts: real sshd on loopback, real processes, pids recycled on
purpose (ns_last_pid), a full disk (a tmpfs), rotated logs, a database locked or read-only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


from orchtest import FAST, TESTS, Orch

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


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


@pytest.fixture
def orch(tmp_path, ssh_fleet) -> Orch:
    overrides = {f"test{i}": {"workdir": str(tmp_path / f"remote{i}")} for i in (1, 2)}
    return Orch(tmp_path / "ws", ssh_fleet.hosts_toml(**overrides))


# --- 4: identity proved before every signal ----------------------------------------------------------


# Runs as a process of its own that reaps orphans at once, as tini or systemd do (this machine's init
# reaps late, so a dead pid would linger as a zombie and never be recycled in time).
RECYCLE_SCENARIO = """
import ctypes, os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_faults import alive, recycle, wait_for
from orchestrator import launch
from orchestrator.hosts import local_host
from orchestrator.launch import RunPaths
from orchestrator.remote import connect

ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the job's processes are reaped here


def reap():
    while True:
        try:
            os.waitid(os.P_ALL, 0, os.WEXITED)
        except ChildProcessError:
            time.sleep(0.001)


threading.Thread(target=reap, daemon=True).start()
root = Path(sys.argv[1])
transport = connect(local_host(root))
# the job ignores SIGTERM (its wrapper does not): the group outlives its leader into the grace window
pid, start = launch.launch(transport, RunPaths(str(root / "run")), launch.job_script("trap '' TERM; sleep 300", {}), "t4")
wait_for(lambda: alive(pid))
outcome = []
killer = threading.Thread(target=lambda: outcome.append(launch.kill(transport, pid, start, grace_s=4)))
killer.start()
wait_for(lambda: not Path(f"/proc/{pid}").exists(), step=0.001)  # SIGTERM ended the wrapper; its job lingers
os.killpg(pid, signal.SIGKILL)  # the job ends too, and the group's id is free again: recycled at once
stranger = recycle(pid)
killer.join(timeout=30)
print(outcome[0], "survived" if alive(stranger.pid) else "signalled")
stranger.kill()
"""


@pytest.mark.skipif(not os.access(NS_LAST_PID, os.W_OK), reason="needs to write ns_last_pid (root)")
def test_a_pid_recycled_in_the_grace_window_is_never_signalled(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-c", RECYCLE_SCENARIO, str(tmp_path), str(TESTS)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["stopped", "survived"]


# --- 10: the wrapper dies, its job runs on -----------------------------------------------------------


def test_a_dead_wrapper_leaves_the_run_running_and_cancel_stops_its_group(orch: Orch) -> None:
    res = orch("run", "command", "--host", "test1", "--detach", "--set", "cmd=sleep 300 & echo $! > child; wait",
               *FAST, check=0)
    run_id = int(res.stdout)
    run_dir = Path(orch.status(run_id)["remote_dir"])
    wait_for(lambda: (run_dir / "child").exists() and (run_dir / "child").read_text().strip())
    child = int((run_dir / "child").read_text())
    wrapper = int((run_dir / "pid").read_text().split()[0])
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
