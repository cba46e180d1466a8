"""A run interrupted, end to end: Ctrl-C, a detach, a killed controller or job, sshd going down, a log
truncated under the watcher; the real `orch` CLI, real sshd hosts on loopback, real SQLite, real jobs.
(Apart from test_run.py, so the two halves go to two workers.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from orchtest import FAST, job_cmd, kill_controller, release, wait_for_file

HOSTS = ["local", "test1"]


def test_detach_then_watch_logs_and_cancel(orch, tmp_path):
    hold = tmp_path / "hold"  # never released: the job is still there when it is cancelled
    res = orch("run", "command", "--host", "test1", "--detach",
               "--set", job_cmd("--steps", "200", "--sleep", "0.05", "--pause", f"5:{hold}"), *FAST, check=0)
    run_id = int(res.stdout.strip())
    doc = orch.status(run_id)
    assert doc["status"] == "running" and doc["pid"] > 0
    orch.wait_for(run_id, lambda d: (orch("status", "--refresh", str(run_id), check=0) and d["progress"]))
    assert "job starting" in orch("logs", str(run_id), "-n", "40", check=0).stdout
    res = orch("cancel", str(run_id), "--grace", "2", check=0)
    doc = orch.status(run_id)
    assert doc["status"] == "cancelled" and "cancelled by user" in doc["reason"]
    assert orch("watch", str(run_id)).returncode == 1
    assert orch("cancel", str(run_id)).returncode == 1  # already ended


def test_controller_killed_then_watch_finishes_without_losing_events(orch, tmp_path):
    marker = tmp_path / "half"
    proc = orch.spawn("run", "command", "--host", "test1",
                      "--set", job_cmd("--steps", "60", "--sleep", "0.1", "--marker", str(marker)), *FAST)
    wait_for_file(marker)
    kill_controller(proc)  # its host's watcher goes on; `orch watch` follows it to the end
    before = orch.status(1)
    assert before["status"] == "running"
    events_before = before["events"]
    res = orch("watch", "1", timeout=120)
    assert res.returncode == 0, res.stderr
    after = orch.status(1)
    assert after["status"] == "succeeded"
    assert after["events"][: len(events_before)] == events_before
    assert after["progress"]["done"] == 60
    # the log was read exactly once: no duplicated phase events
    assert [e["message"] for e in after["events"] if e["kind"] == "phase"].count("running") == 1


def test_sshd_down_mid_watch_then_back(orch, ssh_fleet_restarts, tmp_path):
    server = ssh_fleet_restarts.server(1)
    marker = tmp_path / "half"
    proc = orch.spawn("run", "command", "--host", "test1",
                      "--set", job_cmd("--steps", "30", "--sleep", "0.1", "--marker", str(marker)), *FAST)
    wait_for_file(marker)
    server.stop()
    # down longer than the retry policy absorbs: until the watcher has recorded the host unreachable
    orch.wait_for(1, lambda d: "unreachable" in [e["kind"] for e in d["events"]])
    server.start()
    _, errs = proc.communicate(timeout=120)
    assert proc.returncode == 0, errs
    doc = orch.status(1)
    assert doc["status"] == "succeeded"
    kinds = [e["kind"] for e in doc["events"]]
    assert "unreachable" in kinds and "reconnected" in kinds


@pytest.mark.parametrize("how", ["job", "group", "reboot"])
def test_job_killed_from_outside(orch, how):
    res = orch("run", "command", "--host", "test1", "--detach",
               "--set", job_cmd("--steps", "400", "--sleep", "0.05"), *FAST, check=0)
    run_id = int(res.stdout)
    doc = orch.status(run_id)
    pid_dir = Path(doc["remote_dir"])
    wrapper = int((pid_dir / ".orch" / "pid").read_text().split()[0])
    time.sleep(0.5)
    if how == "job":
        # the job (a child of the wrapper) dies; the wrapper writes exit code 137
        children = [int(p) for p in os.popen(f"pgrep -P {wrapper}").read().split()]
        for c in children:
            os.kill(c, signal.SIGKILL)
    else:
        if how == "reboot":
            shutil.rmtree(pid_dir)  # /tmp cleaned on the way up (first: its watcher may look at any moment)
        os.killpg(wrapper, signal.SIGKILL)  # everything, as a reboot or the OOM killer would
    res = orch("watch", str(run_id))
    doc = orch.status(run_id)
    assert res.returncode == 1
    if how == "job":
        assert doc["status"] == "failed" and doc["exit_code"] == 137 and "SIGKILL" in doc["reason"]
    elif how == "group":
        assert doc["status"] == "lost" and "no exit code" in doc["reason"]
    else:
        assert doc["status"] == "lost" and "run dir" in doc["reason"] and "is gone" in doc["reason"]


@pytest.mark.parametrize("host", HOSTS)
def test_ctrl_c_detaches_and_the_job_keeps_running(orch, tmp_path, host):
    """Ctrl-C ends `orch run` at once with one line saying the run goes on and how to follow it; a
    second Ctrl-C right after is no traceback."""
    marker, hold = tmp_path / "half", tmp_path / "hold"  # the job waits at its end until the test lets it
    proc = orch.spawn("run", "command", "--host", host, "--set",
                      job_cmd("--steps", "10", "--sleep", "0.01", "--marker", str(marker), "--pause", f"end:{hold}"),
                      *FAST)
    wait_for_file(marker)
    time.sleep(0.3)  # in the middle of a wait
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, errs = proc.communicate(timeout=30)  # while the job is held: the Ctrl-C, nothing else, ended it
    took = time.monotonic() - sent
    print(f"{host}: SIGINT to exit {took:.2f} s")
    assert proc.returncode == 0, errs
    assert "Traceback" not in errs and "KeyboardInterrupt" not in errs
    last = errs.strip().splitlines()[-1]
    assert last.startswith("orch: detached; run 1 goes on (") and last.endswith("orch watch 1 · orch logs 1 -f")
    assert sum("detached" in line for line in errs.splitlines()) == 1
    doc = orch.status(1)
    assert doc["status"] == "running" and any(e["kind"] == "detached" for e in doc["events"])
    release(hold)
    assert orch("watch", "1", timeout=120).returncode == 0
    assert orch.status(1)["status"] == "succeeded" and orch.status(1)["progress"]["done"] == 10


def test_ctrl_c_detaches_orch_watch_at_once(orch, tmp_path):
    marker, hold = tmp_path / "half", tmp_path / "hold"
    run_id = int(orch("run", "command", "--host", "test1", "--detach", "--set",
                      job_cmd("--steps", "10", "--sleep", "0.01", "--marker", str(marker), "--pause", f"end:{hold}"),
                      *FAST, check=0).stdout)
    wait_for_file(marker)
    proc = orch.spawn("watch", str(run_id))
    assert proc.stderr.readline()  # its first line: it follows the record
    time.sleep(0.3)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, errs = proc.communicate(timeout=30)  # while the job is held: the Ctrl-C ended it
    took = time.monotonic() - sent
    print(f"watch: SIGINT to exit {took:.2f} s")
    assert proc.returncode == 0 and "Traceback" not in errs, errs
    assert errs.strip().splitlines()[-1].startswith(f"orch: detached; run {run_id} goes on")
    assert orch.status(run_id)["status"] == "running"
    release(hold)
    assert orch.wait_for(run_id, lambda d: d["status"] == "succeeded", timeout=120)["progress"]["done"] == 10


def test_ctrl_c_in_the_queue_starts_nothing(orch, tmp_path):
    hold = tmp_path / "hold"  # the run holding the host ends when the test says
    held = int(orch("run", "command", "--host", "local", "--detach", "--set",
                    f"cmd=while [ ! -e {hold} ]; do sleep 0.05; done", *FAST, check=0).stdout)
    proc = orch.spawn("run", "command", "--host", "local", "--queue", "--set", "cmd=true", *FAST)
    deadline = time.monotonic() + 30
    while "waiting:" not in (proc.stderr.readline() if proc.poll() is None else "waiting:"):
        assert time.monotonic() < deadline
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, errs = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == 130 and "Traceback" not in errs, (proc.returncode, errs)
    assert errs.strip().splitlines()[-1].startswith(f"orch: stopped waiting; no run was started (host local is busy "
                                                    f"with run {held}")
    print(f"queue: SIGINT to exit {took:.2f} s")
    assert [r["id"] for r in json.loads(orch("status", "--json", check=0).stdout)] == [held]
    orch("cancel", str(held), check=0)


def test_truncated_log_is_read_again_from_the_start(orch, tmp_path):
    gate = tmp_path / "truncate"  # the log is truncated once its first lines are recorded
    cmd = (f"cmd=for i in 1 2 3 4 5 6 7 8; do echo \"before truncation line $i\"; done; "
           f"while [ ! -e {gate} ]; do sleep 0.05; done; truncate -s 0 log; echo after; sleep 1")
    run_id = int(orch("run", "command", "--host", "test1", "--detach", "--set", cmd, *FAST, check=0).stdout)
    # the log's first lines recorded (the read offset past them, in the same write)
    orch.wait_for(run_id, lambda d: (d["last_line"] or "").startswith("before truncation line"))
    gate.touch()
    assert orch("watch", str(run_id)).returncode == 0
    doc = orch.status(run_id)
    assert any(e["kind"] == "log" and "truncated" in e["message"] for e in doc["events"])
    assert orch("logs", "1", check=0).stdout == "after\n"  # appended at the new end: no hole of zeros
