"""Live: news within seconds, every active run watched, runs whose controller died settled (real sshd)."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from orchtest import FAST, Orch, job_cmd, reached, release, stop_background_watchers

from orchestrator.logparse import LogParser
from orchestrator.runflow import END_STEPS
from orchestrator.store import Store, lease

EMULATOR = Path(__file__).parent / "fakes" / "sglang_emulator.py"
FAKES = Path(__file__).parent / "fakes"
SLOW_POLLS = ["--set", "poll_min=30", "--set", "poll_max=60"]  # news within seconds is no poll's doing
PUSHED_S = 15  # a generous bound for news the host's agent pushes (a poll comes 30 s after launch at the
               # soonest); the seconds it really takes: bench/detection_lag.py


def marks(path: Path) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        ts, event = line.split()
        found.setdefault(event, float(ts))
    return found


def emulator(events: Path, *flags: str) -> str:
    argv = [sys.executable, str(EMULATOR), "--shards", "4", "--shard-time", "0.3", "--events", str(events), *flags]
    return "cmd=" + " ".join(shlex.quote(a) for a in argv)


def event_time(doc: dict, kind: str, message: str) -> float | None:
    return next((e["ts"] for e in doc["events"] if e["kind"] == kind and e["message"].startswith(message)), None)


def test_ready_and_fatal_lines_reach_status_within_two_seconds(orch: Orch, tmp_path: Path) -> None:
    """Held polls of 30 to 60 s still hear of a ready line, and of a fatal line while the process lingers,
    long before any poll; a detached run's status is current without --refresh."""
    events = tmp_path / "events"
    res = orch("run", "command", "--host", "test1", "--detach", "--set", "engine=sglang", *SLOW_POLLS,
               "--set", emulator(events, "--serve-after", "6", "--crash-after-ready", "0", "--linger"), check=0)
    run_id = int(res.stdout)
    ready = orch.wait_for(run_id, lambda d: d["phase"] in ("ready", "running"), timeout=60)
    seen_ready = time.time()
    assert seen_ready - marks(events)["ready"] < PUSHED_S  # the status command itself included
    assert event_time(ready, "phase", "ready") - marks(events)["ready"] < PUSHED_S
    failed = orch.wait_for(run_id, lambda d: d["status"] == "failed", timeout=60)
    assert "fatal error in log" in failed["reason"]
    assert failed["ended_at"] - marks(events)["crash"] < PUSHED_S
    wrapper = failed["pid"]
    deadline = time.time() + 30  # the lingering ranks are stopped: their GPUs free up
    while Path(f"/proc/{wrapper}").exists() and "Z" not in Path(f"/proc/{wrapper}/stat").read_text().split()[2]:
        assert time.time() < deadline, "the process group still runs"
        time.sleep(0.1)


def test_a_killed_watcher_is_replaced_and_nothing_is_recorded_twice(orch: Orch, tmp_path: Path) -> None:
    """Whatever watches the run is killed -9 while the server loads, while its decode lines stream, and
    once it is quiet before its end; each time `orch status` finds it unwatched and starts a new watcher.
    The server is held at each point until the test lets it go: it cannot end before the last kill."""
    events = tmp_path / "events"
    loading, streaming, ending = tmp_path / "loading", tmp_path / "streaming", tmp_path / "ending"
    res = orch("run", "command", "--host", "test1", "--detach", "--set", "engine=sglang", *FAST,
               "--set", emulator(events, "--decode-stats", "40", "--decode-interval", "0.05",
                                 "--pause", f"shard:2:{loading}", "--pause", f"decode:10:{streaming}",
                                 "--pause", f"end:{ending}"), check=0)
    run_id = int(res.stdout)
    home = Path(os.environ["HOME"])

    def replace_the_watcher() -> None:
        stop_background_watchers(home)
        orch("status", check=0)  # finds it unwatched and starts a new watcher

    reached(loading)  # half its shards loaded
    orch.wait_for(run_id, lambda d: (d["progress"] or {}).get("done") == 2, timeout=60)
    replace_the_watcher()
    release(loading)
    reached(streaming)
    orch.wait_for(run_id, lambda d: (d["metric_summaries"] or {}).get("gen_throughput", {}).get("samples") == 10, timeout=60)
    release(streaming)  # 30 more decode lines are written while it is killed and replaced
    replace_the_watcher()
    reached(ending)
    replace_the_watcher()
    assert orch.status(run_id)["status"] == "running"
    release(ending)
    doc = orch.wait_for(run_id, lambda d: d["status"] == "succeeded" and len(d["end_steps"]) == len(END_STEPS), timeout=90)
    phases = [e["message"] for e in doc["events"] if e["kind"] == "phase"]
    parser = LogParser(engine="sglang")  # the whole log read at once: each phase change once
    parser.feed((Path(doc["remote_dir"]) / "log").read_bytes())
    parser.finish(exit_code=0)
    assert phases == parser.phases_passed, phases
    finished = [e["message"] for e in doc["events"] if e["kind"] == "finished"]
    assert sorted(finished) == sorted(END_STEPS)
    # every decode line once: none lost, none doubled
    assert doc["metric_summaries"]["gen_throughput"]["samples"] == 40


def test_a_controller_killed_while_preparing_is_settled(orch: Orch, tmp_path: Path) -> None:
    state = tmp_path / "gpus.json"  # GPU 0 keeps memory in use: the cleanup waits on it
    state.write_text(json.dumps({"gpus": [{"index": 0, "uuid": "GPU-0", "memory_total": 81559, "utilization": 0,
                                           "base_memory": 30000}], "processes": []}))
    orch.env.update(PATH=f"{FAKES}{os.pathsep}{orch.env['PATH']}", ORCH_FAKE_GPU_STATE=str(state))
    proc = orch.spawn("run", "command", "--set", "cmd=true", *FAST)
    deadline = time.time() + 60
    while not orch.status():  # the run is not created yet
        assert time.time() < deadline
        time.sleep(0.1)
    doc = orch.wait_for(1, lambda d: any(e["kind"] == "gpu" for e in d["events"]), timeout=60)
    assert doc["status"] == "preparing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    orch("status", check=0)
    doc = orch.wait_for(1, lambda d: d["status"] == "failed", timeout=30)
    assert "controller died before launch" in doc["reason"]
    # its lease is freed just after the run is marked failed (ending.finish); leases are orch's own
    # bookkeeping, shown by no command: read through the store
    deadline = time.time() + 30
    while lease.held(Store(orch.db)) and time.time() < deadline:
        time.sleep(0.05)
    assert lease.held(Store(orch.db)) == []


def test_a_run_whose_controller_died_while_launching_is_picked_up(orch: Orch, tmp_path: Path) -> None:
    """The wrapper started, the controller died before recording its pid: the watcher reads the pid
    file and watches the job to its end."""
    res = orch("run", "command", "--host", "test1", "--detach", *FAST,
               "--set", job_cmd("--steps", "20", "--sleep", "0.1"), check=0)
    run_id = int(res.stdout)
    stop_background_watchers(Path(os.environ["HOME"]))
    db = sqlite3.connect(orch.db, isolation_level=None)  # a state no command leaves a record in
    # as it was before the pid was recorded, with a starter that is gone
    db.execute("UPDATE runs SET status = 'launching', pid = NULL, pid_start = NULL, watcher = ?, heartbeat = 0"
               " WHERE id = ?", ("elsewhere:1:1", run_id))
    orch("status", check=0)
    doc = orch.wait_for(run_id, lambda d: d["status"] == "succeeded", timeout=60)
    assert any(e["message"].startswith("running: picked up after its controller died") for e in doc["events"])


def counted_up(screen: bytes) -> bool:
    """Three seconds in a row among the elapsed times drawn (`· M:SS`, before the phase's first bar too)."""
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.decode(errors="replace"))
    seconds = {int(m) * 60 + int(s) for m, s in re.findall(r"· (\d+):(\d\d)\b", text)}
    return any({n, n + 1, n + 2} <= seconds for n in seconds)


def test_the_live_view_over_ssh_moves_every_second(orch: Orch, tmp_path: Path) -> None:
    """In a terminal the line is redrawn every second: elapsed time counts up between polls. The job runs
    until the test has seen three seconds in a row counted."""
    hold = tmp_path / "hold"
    argv = [sys.executable, "-m", "orchestrator", "run", "command", "--host", "test1", *SLOW_POLLS,
            "--set", job_cmd("--steps", "1", "--sleep", "0", "--pause", f"end:{hold}")]
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, env={**orch.env, "TERM": "xterm", "COLUMNS": "160"}, stdin=follower,
                            stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    screen = b""
    deadline = time.time() + 90
    while proc.poll() is None and time.time() < deadline:
        if select.select([leader], [], [], 0.2)[0]:
            try:
                screen += os.read(leader, 65536)
            except OSError:
                break
        if counted_up(screen):
            release(hold)
    release(hold)
    proc.wait(timeout=60)
    assert counted_up(screen), screen.decode(errors="replace")[-2000:]
    assert proc.returncode == 0


class DarkLink:
    """A real sshd in a network namespace of its own, reached over a veth pair whose link a test can cut."""

    def __init__(self, root: Path, authorized_keys: Path):
        from sshd import SSHServer

        tag = f"{os.getpid() % 10000}"
        self.ns, self.outer, self.inner = f"orch-dark-{tag}", f"od{tag}o", f"od{tag}i"
        self._ip("netns", "add", self.ns)
        self._ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        self._ip("link", "set", self.inner, "netns", self.ns)
        self._ip("addr", "add", "198.18.0.1/30", "dev", self.outer)
        self._ip("link", "set", self.outer, "up")
        for args in (["addr", "add", "198.18.0.2/30", "dev", self.inner], ["link", "set", self.inner, "up"],
                     ["link", "set", "lo", "up"]):
            self._ip("netns", "exec", self.ns, "ip", *args)
        self.server = SSHServer(root, "198.18.0.2", authorized_keys, port=2200 + int(tag) % 1000,
                                prefix=["ip", "netns", "exec", self.ns])
        self.server.start()

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def link(self, up: bool) -> None:
        self._ip("link", "set", self.outer, "up" if up else "down")

    def close(self) -> None:
        self.server.stop()
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, check=False)


@pytest.fixture
def dark_link(tmp_path: Path, ssh_fleet):
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    link = DarkLink(tmp_path / "dark-sshd", ssh_fleet.authorized_keys)
    known = tmp_path / "known_hosts"
    known.write_text(link.server.host_key_line + "\n")
    yield link, known
    link.close()


def test_a_link_gone_dark_mid_watch_is_noticed_within_30_s(tmp_path: Path, ssh_fleet, dark_link) -> None:
    link, known = dark_link
    host = {"address": "198.18.0.2", "port": link.server.port, "user": ssh_fleet.user,
            "identity_file": str(ssh_fleet.client_key), "known_hosts": str(known),
            "workdir": str(tmp_path / "r-dark"), "python": sys.executable}
    orch = Orch(tmp_path / "ws", "[hosts.dark]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in host.items()))
    res = orch("run", "command", "--host", "dark", "--detach", "--set", "poll_min=1", "--set", "poll_max=5",
               "--set", job_cmd("--steps", "150", "--sleep", "0.5"), check=0)
    run_id = int(res.stdout)
    orch.wait_for(run_id, lambda d: d["progress"] is not None, timeout=60)
    link.link(False)
    cut = time.time()
    doc = orch.wait_for(run_id, lambda d: event_time(d, "unreachable", "") is not None, timeout=45)
    assert event_time(doc, "unreachable", "") - cut < 30, doc["events"]
    assert (doc["status"], doc["shown_status"]) == ("running", "unreachable")  # as `orch status` shows it
    link.link(True)
    # shown running again once it answers (on a loaded machine a slow first answer may be called
    # unreachable once more before the link settles)
    orch.wait_for(run_id, lambda d: event_time(d, "reconnected", "") is not None and d["shown_status"] == "running"
                  and d["unreachable_since"] is None, timeout=60)
    orch("cancel", str(run_id), "--grace", "1", check=0)


def test_a_host_that_never_comes_back_ends_the_run_lost(tmp_path: Path, ssh_fleet_restarts) -> None:
    fleet = ssh_fleet_restarts
    orch = Orch(tmp_path / "ws", fleet.hosts_toml(test2={"workdir": str(tmp_path / "r2"), "unreachable_give_up_s": 3}))
    res = orch("run", "command", "--host", "test2", "--detach", "--set", "poll_min=0.2", "--set", "poll_max=1",
               "--set", job_cmd("--steps", "600", "--sleep", "0.1"), check=0)
    run_id = int(res.stdout)
    doc = orch.wait_for(run_id, lambda d: d["progress"] is not None, timeout=60)
    fleet.server(2).stop()
    try:
        doc = orch.wait_for(run_id, lambda d: d["status"] == "lost", timeout=90)
        assert "has not answered for" in doc["reason"] and "unreachable_give_up_s" in doc["reason"]
        assert event_time(doc, "unreachable", "") is not None
    finally:
        os.killpg(doc["pid"], signal.SIGKILL)  # the job lived on, out of reach
