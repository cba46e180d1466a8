"""The host agent's protocol and its host-side logic, over a pipe to a real agent process (no sshd)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from orchestrator.config.hosts import Host
from orchestrator.host import agent as agent_client
from orchestrator.host import hostprogram
from orchestrator.host.agent import AgentError, AgentLink, Push
from orchestrator.host.hostjobs import following, procs, protocol
from orchestrator.host.launch import pushed_state
from orchestrator.host.transport import LocalTransport, Stream


def placing(workdir: Path) -> Host:
    """A host on this machine whose programs are placed in its workdir: a batch scheduler's, whose nodes
    reach them only there (the plain local host runs orch's own copy)."""
    return Host(name="cluster", scheduler="slurm", workdir=str(workdir), python=sys.executable)


@pytest.fixture
def link(tmp_path: Path):
    host = placing(tmp_path / "work")
    link = AgentLink.start(LocalTransport(host))
    yield link
    link.close()


def states(link: AgentLink, key: str, until, timeout: float = 20) -> list[dict]:
    """The state pushes of one run, until `until(pushes so far)` holds."""
    got: list[dict] = []
    deadline = time.monotonic() + timeout
    while not got or not until(got):
        assert time.monotonic() < deadline, f"no such state within {timeout} s: {got[-3:]}"
        try:
            push: Push = link.pushes.get(timeout=0.5)
        except queue.Empty:
            continue
        if push.kind == "state" and push.key == key:
            got.append(push.doc)
    return got


def log_of(pushes: list[dict]) -> bytes:
    return b"".join(p["data"] for p in pushes)


def test_hello_is_the_placed_version_and_the_file_is_content_addressed(link: AgentLink, tmp_path: Path):
    assert link.info["sha256"] == agent_client.digest()
    assert link.info["pid"] != os.getpid()
    placed = [p.name for p in (tmp_path / "work" / "runs" / "hostjobs").iterdir()]
    assert placed == [f"hostjobs-{agent_client.digest()[:16]}.zip"]


def test_a_launched_job_is_followed_to_its_exit_with_every_byte(link: AgentLink, tmp_path: Path):
    root = str(tmp_path / "work" / "runs" / "1")
    script = "for i in $(seq 50); do echo line $i; sleep 0.01; done\nprintf 'no newline at the end'\nexit 3\n"
    job = link.call("launch", dir=root, script=script, token="tok-1")
    assert job["pid"] > 0 and job["start"].isdigit() and not job["again"]
    link.tell("follow", key="1", dir=root, pid=job["pid"], start=job["start"], offset=0)
    got = states(link, "1", lambda s: s[-1]["exit_code"] is not None and s[-1]["offset"] + len(
        s[-1]["data"]) >= s[-1]["size"])
    assert log_of(got) == Path(root, "log").read_bytes()
    assert got[-1]["exit_code"] == 3 and got[-1]["ended_at"] >= got[-1]["started_at"]
    state = pushed_state(got[-1])
    assert state.exit_code == 3 and state.started_at is not None
    # the same token again: the same job, never a second one
    again = link.call("launch", dir=root, script=script, token="tok-1")
    assert (again["pid"], again["again"]) == (job["pid"], True)


def test_a_run_dir_of_another_token_is_refused(link: AgentLink, tmp_path: Path):
    root = str(tmp_path / "work" / "runs" / "2")
    link.call("launch", dir=root, script="true\n", token="mine")
    with pytest.raises(AgentError, match="in use by another run"):
        link.call("launch", dir=root, script="true\n", token="theirs")


def test_kill_stops_the_job_group_and_never_a_process_it_cannot_prove(link: AgentLink, tmp_path: Path):
    root = str(tmp_path / "work" / "runs" / "3")
    job = link.call("launch", dir=root, script="sleep 300 & sleep 300\n", token="t")
    members = procs.group_pids(job["pid"])
    assert len(members) >= 2
    # a start time that is not the process's: nothing is signalled
    assert link.call("kill", pid=job["pid"], start=str(int(job["start"]) + 1), grace_s=1)["outcome"] == "gone"
    assert all(procs.live_start(m) for m in members)
    assert link.call("kill", pid=job["pid"], start=job["start"], grace_s=5)["outcome"] == "stopped"
    deadline = time.monotonic() + 5
    while any(procs.live_start(m) for m in members):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_members_outliving_their_wrapper_are_the_jobs_only_with_its_mark(tmp_path: Path):
    proc = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    try:
        start = procs.start_time(proc.pid)
        assert procs.ours(proc.pid, start) == "group"
        assert procs.ours(proc.pid, str(int(start) + 5)) is None  # another process at that pid
        assert procs.ours(proc.pid, "") is None  # no start time: nothing is provably the job
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("leader", ["running", "exited"])  # exited: a zombie its parent has not reaped yet
@pytest.mark.parametrize(("kernel", "calls"), [("6.9 or newer", "python"), ("older", "python"), ("older", "libc")])
def test_a_group_is_signalled_through_a_hold_on_its_leader(kernel: str, calls: str, leader: str,
                                                           monkeypatch: pytest.MonkeyPatch):
    if calls == "libc":  # as on Python 3.8: the system calls through libc
        monkeypatch.delattr(os, "pidfd_open")
        monkeypatch.delattr(signal, "pidfd_send_signal")
    if kernel == "older":  # a flag the kernel does not know is refused (EINVAL), as the group flag is before 6.9
        monkeypatch.setattr(procs, "PIDFD_SIGNAL_PROCESS_GROUP", 1 << 30)
        calls = []
        members_of = procs._signal_members
        monkeypatch.setattr(procs, "_signal_members", lambda *a: calls.append(a) or members_of(*a))
    else:
        monkeypatch.setattr(procs, "_signal_members", lambda *a: pytest.fail("one call signals the group"))
    end = "wait" if leader == "running" else "exit 0"
    proc = subprocess.Popen(["bash", "-c", f"sleep 300 & sleep 300 & {end}"], start_new_session=True)
    try:
        if leader == "running":
            wait_for(lambda: len(procs.group_pids(proc.pid)) == 3)
        else:
            wait_for(lambda: procs.live_start(proc.pid) is None and len(procs.group_pids(proc.pid)) == 2)
        assert procs.ours(proc.pid, procs.start_time(proc.pid)) == "group"
        members = procs.group_pids(proc.pid)
        assert procs.signal_job(proc.pid, procs.start_time(proc.pid), signal.SIGKILL)
        wait_for(lambda: not any(procs.live_start(m) for m in members))
        assert kernel != "older" or len(calls) == 1
    finally:
        proc.kill()
        proc.wait()


def test_unknown_ops_and_garbage_lines_are_answered_and_the_agent_goes_on(link: AgentLink):
    with pytest.raises(AgentError, match="unknown op"):
        link.call("rm -rf /")
    link._stream.send(b"{not json\n")
    assert link.call("ping") == {}


def test_the_agent_exits_when_its_channel_closes(tmp_path: Path):
    host = Host(name="local", workdir=str(tmp_path / "w"), python=sys.executable)
    link = AgentLink.start(LocalTransport(host))
    pid = link.info["pid"]
    link.close()
    deadline = time.monotonic() + 10
    while procs.live_start(pid):
        assert time.monotonic() < deadline, "the agent outlived its channel"
        time.sleep(0.05)


def test_an_agent_file_swapped_on_the_host_is_never_run_but_placed_again(tmp_path: Path):
    host = placing(tmp_path / "w")
    transport = LocalTransport(host)
    AgentLink.start(transport).close()
    placed = Path(agent_client.remote_path(transport))
    marker = tmp_path / "swapped-code-ran"
    with zipfile.ZipFile(placed, "w") as swapped:  # the same package, its entry leaving a mark
        swapped.writestr("hostjobs/__init__.py", "")
        swapped.writestr("hostjobs/main.py", f"open({str(marker)!r}, 'w').close()\ndef main(argv): return 0\n")
    link = AgentLink.start(transport)
    link.close()
    assert not marker.exists()
    assert placed.read_bytes() == agent_client.source()


# -- the log, followed by the host-side logic itself -----------------------------------------------
def follow(root: Path, **req) -> following.WatchedRun:
    return following.WatchedRun({"key": "9", "dir": str(root), **req})


def drain(f: following.WatchedRun) -> bytes:
    out = b""
    for _ in range(10_000):
        doc = f.state(time.monotonic())
        if doc is None:
            return out
        out += doc["data"]
    raise AssertionError("the log never ran dry")


def test_a_log_renamed_away_is_read_to_its_end_then_the_new_one(tmp_path: Path):
    log = tmp_path / "log"
    log.write_bytes(b"one\ntwo\n")
    f = follow(tmp_path)
    assert drain(f) == b"one\ntwo\n"
    with open(log, "ab", buffering=0) as old:
        old.write(b"three\n")
        log.rename(tmp_path / "log.old")
        log.write_bytes(b"")
        assert drain(f) == b"three\n"  # the new log is empty: the writer still writes to the old one
        old.write(b"four\n")
    log.write_bytes(b"new-1\n")
    assert drain(f) == b"four\nnew-1\n"


def test_a_log_looked_at_between_its_rename_and_its_new_file_loses_nothing(tmp_path: Path):
    """`mv log log.1 && : > log` leaves a moment with no log: a look then decides nothing."""
    log = tmp_path / "log"
    log.write_bytes(b"one\n")
    f = follow(tmp_path)
    assert drain(f) == b"one\n"
    with open(log, "ab", buffering=0) as old:
        log.rename(tmp_path / "log.1")
        assert drain(f) == b""  # no log here now
        old.write(b"two\n")
        log.write_bytes(b"")
        assert drain(f) == b"two\n"  # the writer still writes to the renamed file
        old.write(b"three\n")
    log.write_bytes(b"new-1\n")
    assert drain(f) == b"three\nnew-1\n"


def test_a_log_truncated_in_place_is_read_from_its_copy_then_from_zero(tmp_path: Path):
    log = tmp_path / "log"
    log.write_bytes(b"a" * 100 + b"\n")
    f = follow(tmp_path)
    assert len(drain(f)) == 101
    with open(log, "ab", buffering=0) as w:
        w.write(b"tail of the old\n")
    (tmp_path / "log.1").write_bytes(log.read_bytes())  # copytruncate
    log.write_bytes(b"")
    with open(log, "ab", buffering=0) as w:
        w.write(b"fresh\n")
    assert drain(f) == b"tail of the old\nfresh\n"


def test_a_resumed_follow_checks_the_bytes_before_its_offset(tmp_path: Path):
    log = tmp_path / "log"
    log.write_bytes(b"x" * 200 + b"\nmore\n")
    kept = b"x" * 64
    assert drain(follow(tmp_path, offset=200, tail=kept.hex())) == b"\nmore\n"
    log.write_bytes(b"y" * 300)  # rewritten under the offset: read again from 0
    assert drain(follow(tmp_path, offset=200, tail=kept.hex())) == b"y" * 300


def test_a_huge_line_comes_in_bounded_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(following, "CHUNK", 1 << 16)
    (tmp_path / "log").write_bytes(b"z" * (5 << 20))  # 5 MiB, no newline
    f = follow(tmp_path)
    sizes = []
    while (doc := f.state(time.monotonic())) is not None:
        sizes.append(len(doc["data"]))
    assert sum(sizes) == 5 << 20 and max(sizes) == 1 << 16


def test_quiet_runs_push_nothing_until_poked(tmp_path: Path):
    (tmp_path / "log").write_bytes(b"hello\n")
    f = follow(tmp_path)
    assert f.state(0.0) is not None
    assert f.state(1.0) is None
    f.wanted = True
    doc = f.state(2.0)
    assert doc is not None and doc["data"] == b"" and doc["offset"] == 6


def test_the_protocol_is_json_lines(tmp_path: Path):
    """Spoken by hand: a request line in, a reply line out, whatever else the agent pushes meanwhile."""
    proc = subprocess.Popen([sys.executable, "-I", "-u", "-c", hostprogram.SOURCES_RUN, hostprogram.TOP], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b'{"id": 7, "op": "hello"}\n')
    proc.stdin.flush()
    reply = json.loads(proc.stdout.readline())
    assert reply["id"] == 7 and reply["ok"] and reply["result"]["sha256"] == agent_client.digest()
    # file bytes travel raw: the reply's line counts them, they follow it, then the next line
    blob = tmp_path / "blob"
    blob.write_bytes(b"a\nb\0\xff\n")
    proc.stdin.write(b'{"id": 8, "op": "chunk", "path": "%s", "offset": 1}\n' % bytes(blob))
    proc.stdin.flush()
    reply = json.loads(proc.stdout.readline())
    while "push" in reply:  # a heartbeat meanwhile
        reply = json.loads(proc.stdout.readline())
    assert reply == {"id": 8, "ok": True, "result": {}, "bytes": 5}
    assert proc.stdout.read(5) == b"\nb\0\xff\n"
    proc.stdin.write(b'{"id": 9, "op": "ping"}\n')
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"id": 9, "ok": True, "result": {}}
    proc.stdin.close()
    assert proc.wait(timeout=10) == 0


class Pieces(Stream):
    """The agent's output as it may come off a channel: in pieces cut anywhere."""

    def __init__(self, data: bytes, cut: int):
        self.pieces = [data[i:i + cut] for i in range(0, len(data), cut)]
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def recv(self, n: int) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""

    def close(self) -> None:
        pass


@pytest.mark.parametrize("cut", [1, 7, 4096])
def test_raw_bytes_after_a_line_are_read_whole_however_the_channel_cuts_them(cut: int):
    payload = b"line\n\r\0" * 300 + b"no newline"
    out = (b'login banner\n{"push": "state", "key": "1", "bytes": %d}\n' % len(payload) + payload
           + b'{"push": "state", "key": "1", "bytes": 0}\n{"push": "beat"}\n')
    link = AgentLink(LocalTransport(Host(name="local")), Pieces(out, cut))
    got = [link.pushes.get(timeout=10) for _ in range(4)]
    assert [(p.kind, p.size) for p in got] == [("state", len(payload)), ("state", 0), ("beat", 0), ("closed", 0)]
    assert got[0].doc["data"] == payload and got[1].doc["data"] == b""


def test_a_backlog_goes_out_within_the_window_and_on_as_it_is_acknowledged(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(protocol, "CHUNK", 100)
    monkeypatch.setattr(following, "CHUNK", 100)
    monkeypatch.setattr(protocol, "WINDOW", 250)
    sent: list[dict] = []
    monkeypatch.setattr(protocol, "send", sent.append)
    for key in ("a", "b"):
        (tmp_path / key).mkdir()
        (tmp_path / key / "log").write_bytes(key.encode() * 1000)
    agent = protocol.Agent()
    for key in ("a", "b"):
        agent.follow({"key": key, "dir": str(tmp_path / key)})
    assert agent.tick()  # more to push at once: no tick's wait
    assert not agent.tick()  # the window is full
    assert sum(len(d["data"]) for d in sent) == 250 and {d["key"] for d in sent} == {"a", "b"}
    agent.tick()
    assert sum(len(d["data"]) for d in sent) == 250  # nothing more until the watcher acknowledges
    for _ in range(100):  # at most as many bytes more as were acknowledged, to the end of both logs
        before = len(sent)
        agent.ack({"bytes": 250})
        agent.tick()
        pushed = sum(len(d["data"]) for d in sent[before:])
        assert pushed <= 250
        if not pushed:
            break
    for key in ("a", "b"):
        assert b"".join(d["data"] for d in sent if d["key"] == key) == key.encode() * 1000
    assert not agent.tick() and sum(len(d["data"]) for d in sent[before:]) == 0


# -- the ops that replaced shell: each argument checked, argv lists only ---------------------------------
@pytest.mark.parametrize("op, args, why", [
    ("kill", {"pid": 1, "start": "1; rm -rf /"}, "bad start"),
    ("kill", {"pid": "1", "start": "12"}, "bad pid"),
    ("kill", {"pid": 1}, "missing argument start"),
    ("read", {"dir": "relative/run"}, "bad dir"),
    ("read", {"dir": "/tmp/x", "command": "id"}, "unknown argument"),
    ("health", {"url": "file:///etc/passwd"}, "bad url"),
    ("kill_pids", {"procs": [[0, "5"]]}, "bad procs"),
    ("submit", {"dir": "/tmp/x", "script": "true", "token": "t", "options": ["x; id"]}, "bad options"),
    ("sinfo", {"what": "-o %all"}, "bad what"),
    ("stat", {"path": "relative/file"}, "bad path"),
    ("listdir", {"path": "/tmp", "most": -1}, "bad most"),
    ("usage", {"path": "/tmp\0x"}, "bad path"),
    ("exec", {"argv": "id; rm -rf /"}, "bad argv"),
    ("exec", {"argv": []}, "bad argv"),
    ("exec", {"argv": ["", "x"]}, "bad argv"),
    ("exec", {"argv": ["echo", "a\0b"]}, "bad argv"),
    ("exec", {"argv": ["id"], "shell": True}, "unknown argument"),
    ("exec", {"argv": ["id"], "timeout_s": 10**6}, "bad timeout_s"),
    ("program", {"python": "python3", "path": "relative.py", "sha256": "0" * 64, "entry": "patch"}, "bad path"),
    ("program", {"python": "python3", "path": "/tmp/p.py", "sha256": "0" * 63, "entry": "patch"}, "bad sha256"),
    ("program", {"python": "python3", "path": "/tmp/p.py", "sha256": "G" * 64, "entry": "patch"}, "bad sha256"),
    ("program", {"python": "python3", "path": "/tmp/p.py", "sha256": "0" * 64}, "missing argument entry"),
    ("program", {"python": "python3", "path": "/tmp/p.py", "sha256": "0" * 64, "entry": "wrap"}, "bad entry"),
    ("lease", {"action": "take", "workdir": "relative"}, "bad workdir"),
    ("lease", {"action": "steal", "workdir": "/tmp"}, "bad action"),
    ("lease", {"action": ["take"], "workdir": "/tmp"}, "bad action"),
    ("sinfo", {"what": ["nodes"]}, "bad what"),
    ("lease", {"action": "take", "workdir": "/tmp", "keys": ["gpu 0"]}, "bad keys"),
    ("lease", {"action": "take", "workdir": "/tmp", "shared": "yes"}, "bad shared"),
    ("program", {"python": "", "path": "/tmp/p.py", "sha256": "0" * 64, "entry": "patch"}, "bad python"),
    ("program", {"python": "python3", "path": "/tmp/p.py", "sha256": "0" * 64, "argv": ["-c", "1"]},
     "unknown argument"),
])
def test_every_op_refuses_an_argument_that_does_not_check(link: AgentLink, op: str, args: dict, why: str):
    with pytest.raises(AgentError, match=why):
        link.call(op, **args)


def wait_for(predicate, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.05)


def test_a_held_read_wakes_on_a_matching_line_and_not_on_others(link: AgentLink, tmp_path: Path):
    root = tmp_path / "work" / "runs" / "4"
    go = tmp_path / "go"
    script = f"echo noise\nwhile [ ! -e {go} ]; do sleep 0.05; done\necho 'The server is fired up and ready'\nsleep 300\n"
    job = link.call("launch", dir=str(root), script=script, token="t4")
    wait_for(lambda: b"noise" in (root / "log").read_bytes())
    answer: list[dict] = []
    reader = threading.Thread(target=lambda: answer.append(link.call(
        "read", timeout=60, dir=str(root), pid=job["pid"], start=job["start"], hold_s=600,
        wake=["fired up and ready"])))
    reader.start()
    reader.join(1.0)
    assert reader.is_alive(), "woke on a line that does not match"
    go.touch()
    reader.join(60)  # a read that never wakes times out: its call raises instead of answering
    state = pushed_state(answer[0])
    assert state.alive and b"noise\nThe server is fired up and ready\n" == state.data
    assert link.call("kill", pid=job["pid"], start=job["start"], grace_s=5)["outcome"] == "stopped"
    # the job ended: a read holds no longer, and says so with every byte
    done = pushed_state(link.call("read", timeout=60, dir=str(root), pid=job["pid"], start=job["start"],
                                  hold_s=600, offset=6, tail=b"noise\n".hex()))
    assert not done.alive and done.offset == 6 and done.data.startswith(b"The server")


def test_a_job_outlives_its_agent_and_its_wrapper_writes_the_exit_code(tmp_path: Path):
    host = Host(name="local", workdir=str(tmp_path / "work"), python=sys.executable)
    link = AgentLink.start(LocalTransport(host))
    root = tmp_path / "work" / "runs" / "5"
    go = tmp_path / "go"
    job = link.call("launch", dir=str(root), script=f"while [ ! -e {go} ]; do sleep 0.05; done\necho done\nexit 4\n",
                    token="t5")
    agent_pid = link.info["pid"]
    assert procs._stat_fields(job["pid"])[1] != str(agent_pid)  # detached: not the agent's child
    link.close()
    wait_for(lambda: not procs.live_start(agent_pid))
    assert procs.live_start(job["pid"]) == job["start"]
    go.touch()
    wait_for(lambda: (root / ".orch" / "exit_code").exists())
    assert (root / ".orch" / "exit_code").read_text() == "4\n" and (root / "log").read_text() == "done\n"
    assert float((root / ".orch" / "ended_at").read_text()) >= float((root / ".orch" / "started_at").read_text())


def test_a_job_killed_by_a_signal_exits_as_a_shell_says_it(link: AgentLink, tmp_path: Path):
    root = tmp_path / "work" / "runs" / "6"
    link.call("launch", dir=str(root), script="kill -9 $$\n", token="t6")
    wait_for(lambda: (root / ".orch" / "exit_code").exists())
    assert (root / ".orch" / "exit_code").read_text() == "137\n"


FAKES = Path(__file__).resolve().parent / "fakes"


def test_gpus_are_read_and_attributed_on_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    state = tmp_path / "gpu-state.json"
    monkeypatch.setenv("ORCH_FAKE_GPU_STATE", str(state))
    host = Host(name="local", workdir=str(tmp_path / "work"), python=sys.executable)
    link = AgentLink.start(LocalTransport(host))  # started with the stand-in first on its PATH
    try:
        root = tmp_path / "work" / "runs" / "7"
        job = link.call("launch", dir=str(root), script="echo $$ > job.pid\nexec sleep 300\n", token="t7")
        wait_for(lambda: (root / "job.pid").exists() and (root / "job.pid").read_text().strip())
        member = int((root / "job.pid").read_text())
        state.write_text(json.dumps({"gpus": [{"index": 0, "uuid": "GPU-a", "na": ["utilization.gpu"]}],
                                     "processes": [{"pid": member, "gpu": 0, "used_memory": 700}]}))
        doc = link.call("gpus")
        assert doc["gpus"] == [{"index": "0", "uuid": "GPU-a", "memory.used": "703", "memory.total": "81559",
                                "utilization.gpu": "[N/A]"}]
        assert doc["apps"] == [{"pid": str(member), "gpu_uuid": "GPU-a", "used_memory": "700"}]
        seen = doc["procs"][str(member)]
        assert (seen["pgid"], seen["group_start"], seen["mark"]) == (job["pid"], job["start"],
                                                                     f"{job['pid']}:{job['start']}")
        assert seen["command"] == "sleep 300" and seen["start"] == procs.start_time(member)
        # a start time that is not the process's: never signalled
        assert link.call("kill_pids", procs=[[member, str(int(seen["start"]) + 1)]], grace_s=1)["outcome"] == "gone"
        assert procs.live_start(member)
        assert link.call("kill_pids", procs=[[member, seen["start"]]], grace_s=5)["outcome"] == "stopped"
        state.unlink()  # the driver gone: nvidia-smi's own words
        assert "couldn't communicate with the NVIDIA driver" in link.call("gpus")["error"]
    finally:
        link.close()


def test_tail_chunk_and_files_never_follow_a_symlink(link: AgentLink, tmp_path: Path):
    root = tmp_path / "run"
    (root / "pulled").mkdir(parents=True)
    (root / "pulled" / "old").write_text("earlier pull")
    (root / "log").write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))
    (root / "secret").symlink_to("/etc/hostname")
    got = link.call("tail", path=str(root / "log"), lines=2)
    assert got == {"text": "line 998\nline 999\n", "size": (root / "log").stat().st_size}
    assert link.call("chunk", path=str(root / "secret"), offset=0, length=100)["data"] == b""
    assert link.call("chunk", path=str(root / "log"), offset=7, length=7)["data"] == b"line 1\n"
    assert link.call("files", dir=str(root))["files"] == [[(root / "log").stat().st_size, "log"]]
    assert link.call("size", path=str(root / "secret"))["size"] is None


def oldest_python() -> str | None:
    """A Python 3.8 on this machine (the oldest the agent supports), if there is one."""
    import glob
    import pwd

    home = pwd.getpwuid(os.getuid()).pw_dir  # the tests' own HOME is a private one
    for found in [*sorted(glob.glob(f"{home}/.pyenv/versions/3.8*/bin/python")), "/usr/bin/python3.8"]:
        if os.access(found, os.X_OK):
            return found
    return None


PYTHON_3_8 = oldest_python()


@pytest.mark.skipif(PYTHON_3_8 is None, reason="no python 3.8 here")
def test_the_agent_and_its_wrapper_run_on_python_3_8(tmp_path: Path):
    host = Host(name="local", workdir=str(tmp_path / "work"), python=str(PYTHON_3_8))
    link = AgentLink.start(LocalTransport(host))
    try:
        assert link.info["python"].startswith("3.8.")
        root = tmp_path / "work" / "runs" / "8"
        job = link.call("launch", dir=str(root), script="echo on 3.8\nexit 5\n", token="t8")
        wait_for(lambda: (root / ".orch" / "exit_code").exists())
        state = pushed_state(link.call("read", dir=str(root), pid=job["pid"], start=job["start"]))
        assert (state.exit_code, state.data) == (5, b"on 3.8\n")
        job = link.call("launch", dir=str(tmp_path / "work" / "runs" / "9"), script="sleep 300 & wait\n", token="t9")
        members = procs.group_pids(job["pid"])
        assert link.call("kill", pid=job["pid"], start=job["start"], grace_s=5)["outcome"] == "stopped"
        wait_for(lambda: not any(procs.live_start(m) for m in members))
    finally:
        link.close()


def test_stacks_are_taken_only_of_processes_proven_the_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if not (Path(sys.executable).parent / "py-spy").exists():
        pytest.skip("no py-spy beside this python")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    host = Host(name="local", workdir=str(tmp_path / "work"), python=sys.executable)
    link = AgentLink.start(LocalTransport(host))
    try:
        root = tmp_path / "work" / "runs" / "9"
        at_line = tmp_path / "at-its-line"  # the job's python has started and reached its one line
        job = link.call("launch", dir=str(root), token="t9",
                        script=f"exec {sys.executable} -c 'import pathlib, time; pathlib.Path(\"{at_line}\").touch(); "
                               "time.sleep(300)'\n")
        assert link.call("stacks", pid=job["pid"], start=str(int(job["start"]) + 1))["text"] == ""
        wait_for(lambda: len(procs.group_pids(job["pid"])) == 2 and at_line.exists())  # wrapper and job
        text = link.call("stacks", timeout=180, pid=job["pid"], start=job["start"])["text"]
        assert text.count("== pid ") == 2 and "(<string>:1)" in text  # the job's python, at its one line
    finally:
        link.call("kill", pid=job["pid"], start=job["start"], grace_s=5)
        link.close()


def test_stat_listdir_and_usage_look_at_files_without_following_a_symlink(link: AgentLink, tmp_path: Path):
    root = tmp_path / "out"
    (root / "1" / "deep").mkdir(parents=True)
    (root / "data_0.pt").write_bytes(b"x" * 5000)
    (root / "1" / "deep" / "w").write_bytes(b"y" * 70000)
    (root / "secret").symlink_to("/etc")
    (tmp_path / "via").symlink_to(root)
    assert link.call("stat", path=str(root / "data_0.pt")) == {"kind": "file", "size": 5000, "to": "file"}
    assert link.call("stat", path=str(root / "secret"))["kind"] == "link"
    assert link.call("stat", path=str(root / "secret"))["to"] == "dir"  # looked at, as `test -d` does
    assert link.call("stat", path=str(root / "nothing")) == {"kind": None, "size": None, "to": None}
    entries = link.call("listdir", path=str(root))["entries"]
    assert [(name, kind) for name, kind, _ in entries] == [("1", "dir"), ("data_0.pt", "file"), ("secret", "link")]
    assert link.call("listdir", path=str(tmp_path / "via"))["entries"] == entries  # the folder named may be a link
    assert link.call("listdir", path=str(root / "data_0.pt"))["entries"] is None
    assert len(link.call("listdir", path=str(root), most=2)["entries"]) == 2
    held = link.call("usage", path=str(root))["usage"]
    found = subprocess.run(["find", str(root), "-mindepth", "1"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert held["entries"] == len(found) == 5  # /etc behind the link is not counted
    du_b = int(subprocess.run(["du", "-sb", str(root)], capture_output=True, text=True, check=True).stdout.split()[0])
    assert held["bytes"] == du_b and held["kib"] >= 70
    assert link.call("usage", path=str(root / "nothing"))["usage"] is None


def test_exec_runs_an_argv_list_without_a_shell(link: AgentLink, tmp_path: Path):
    marker = tmp_path / "injected"
    words = [f"$(touch {marker})", f"; touch {marker}", "a b", "'"]
    got = link.call("exec", argv=[sys.executable, "-c", "import sys; print(sys.argv[1:]); sys.exit(3)", *words])
    assert got == {"code": 3, "stdout": f"{words}\n", "stderr": ""}
    assert not marker.exists()
    missing = link.call("exec", argv=[str(tmp_path / "no-such-python"), "-c", "1"])
    assert missing["code"] == 127 and "No such file" in missing["stderr"]
    # a reply only after the hour's sleep would come past the link's own 60 s wait: Unreachable, not this
    with pytest.raises(AgentError, match="no end within 0.5 s"):
        link.call("exec", argv=["sleep", "3600"], timeout_s=0.5)


def test_on_the_local_host_the_agent_is_orchs_own_copy_and_nothing_is_placed(tmp_path: Path):
    host = Host(name="local", workdir=str(tmp_path / "ws"), python=sys.executable)
    link = AgentLink.start(LocalTransport(host))
    try:
        assert link.info["sha256"] == agent_client.digest()
    finally:
        link.close()
    assert agent_client.remote_path(LocalTransport(host)) == hostprogram.TOP
    assert not (tmp_path / "ws").exists()


def probe_package(folder: Path) -> Path:
    """A package `orchprobe` 1.0 installed in `folder` alone: found only when `folder` is on PYTHONPATH."""
    (folder / "orchprobe").mkdir(parents=True)
    (folder / "orchprobe" / "__init__.py").write_text("")
    (folder / "orchprobe-1.0.dist-info").mkdir()
    (folder / "orchprobe-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: orchprobe\nVersion: 1.0\n")
    return folder


def probe(blob: str = "") -> str:
    """A patch check that finds the probe package: its reply names where the run's python found it."""
    return json.dumps({"action": "check", "set_name": "probe", "package": "orchprobe", "files": {},
                       "state_dir": "/nonexistent", "blob": blob})


def test_a_placed_archive_runs_its_entry_with_the_request_on_stdin_over_a_pipe(tmp_path: Path):
    """The `program` op, spoken by hand: the bootstrap imports the placed archive only when its sha256 is the
    one asked for, the request on its stdin (2 MiB of it in one line), no shell; a swapped file runs nothing."""
    archive = tmp_path / "progs" / "hostjobs-1.zip"
    archive.parent.mkdir()
    archive.write_bytes(hostprogram.archive())
    sha = hostprogram.digest()
    marker = tmp_path / "pwned"
    site = probe_package(tmp_path / f"$(touch {marker})")
    proc = subprocess.Popen([sys.executable, "-I", "-u", "-c", hostprogram.SOURCES_RUN, hostprogram.TOP], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None

    def ask(rid: int, **args) -> dict:
        proc.stdin.write((json.dumps({"id": rid, "op": "program", "entry": "patch", **args}) + "\n").encode())
        proc.stdin.flush()
        while True:
            doc = json.loads(proc.stdout.readline())
            if doc.get("id") == rid:
                return doc

    try:
        blob = "x" * (2 << 20) + f"$(touch {marker})"
        reply = ask(1, python=sys.executable, path=str(archive), sha256=sha, input=probe(blob), pythonpath=str(site))
        assert reply["ok"] and reply["result"]["code"] == 0, reply
        answer = json.loads(reply["result"]["stdout"].splitlines()[-1])
        assert answer["ok"] and (answer["root"], answer["version"]) == (str(site), "1.0")
        archive.write_bytes(b"PK swapped")
        swapped = ask(2, python=sys.executable, path=str(archive), sha256=sha, input="{}")
        assert swapped["result"] == {"code": 97, "stdout": "", "stderr": ""}
        gone = ask(3, python=sys.executable, path=str(tmp_path / "none.zip"), sha256=sha, input="{}")
        assert gone["result"]["code"] == 97 and gone["result"]["stdout"] == ""
        no_python = ask(4, python=str(tmp_path / "no-such-python"), path=str(archive), sha256=sha)
        assert no_python["result"]["code"] == 127 and "No such file" in no_python["result"]["stderr"]
        assert not marker.exists()
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0


def test_agent_program_places_a_missing_or_swapped_archive_and_says_when_it_gives_no_reply(tmp_path: Path):
    host = placing(tmp_path / "work")
    transport = LocalTransport(host)
    site = probe_package(tmp_path / "site")
    try:
        path = hostprogram.remote_path(transport)
        reply = agent_client.program(transport, "patch", json.loads(probe()), pythonpath=str(site))
        assert reply["ok"] and reply["root"] == str(site)
        marker = tmp_path / "pwned"
        Path(path).write_text(f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n")
        assert agent_client.program(transport, "patch", json.loads(probe()), pythonpath=str(site))["ok"]
        assert not marker.exists() and Path(path).read_bytes() == hostprogram.archive()
        from orchestrator.errors import RemoteError

        with pytest.raises(RemoteError, match="the host side's patch gave no reply") as info:
            agent_client.program(transport, "patch", {"action": "check"}, python=str(tmp_path / "no-python"))
        first = str(info.value).splitlines()[0]
        assert first == "cluster: command failed (the host side's patch gave no reply): patch check"
    finally:
        agent_client.shared(transport).close()


def test_a_log_that_cannot_be_read_waits_for_the_tick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(protocol, "send", lambda doc: None)
    (tmp_path / "elsewhere").write_bytes(b"x" * 5000)
    (tmp_path / "log").symlink_to(tmp_path / "elsewhere")  # sized through the link, never read through it
    agent = protocol.Agent()
    agent.follow({"key": "a", "dir": str(tmp_path)})
    assert not agent.tick()  # nothing read: no pushing at once, over and over


# --- a run dir nobody else can swap, nothing imported from where a program starts ---------------------------


def planted(folder: Path, marker: Path) -> None:
    """A `hashlib.py` in `folder` that leaves `marker` if anything imports it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hashlib.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text(__file__)\n")


def test_nothing_is_imported_from_the_run_dir_or_the_folder_the_agent_starts_in(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The agent (started in the folder orch stands in), its job wrapper (started in the run dir) and the
    host programs it runs each start with only absolute folders on sys.path: a planted `hashlib.py` in
    either place is never imported."""

    marker = tmp_path / "pwned"
    here = tmp_path / "here"
    planted(here, marker)
    root = tmp_path / "work" / "runs" / "11"
    planted(root, marker)
    monkeypatch.chdir(here)
    for host in (Host(name="local", workdir=str(tmp_path / "work"), python=sys.executable), placing(tmp_path / "work")):
        link = AgentLink.start(LocalTransport(host))
        try:
            job = link.call("launch", dir=str(root), script="echo job ran\n", token="t11")
            wait_for(lambda: (root / ".orch" / "exit_code").exists())
            assert (root / "log").read_text() == "job ran\n" and job["pid"] > 0
            archive = tmp_path / "progs" / "hostjobs.zip"
            archive.parent.mkdir(exist_ok=True)
            archive.write_bytes(hostprogram.archive())
            reply = link.call("program", python=sys.executable, path=str(archive), sha256=hostprogram.digest(),
                              entry="patch", input=json.dumps({"action": "status", "state_dir": "/nonexistent"}))
            assert reply["code"] == 0, reply
        finally:
            link.close()
        assert not marker.exists(), marker.read_text()


def test_a_pid_file_naming_another_process_is_never_adopted(link: AgentLink, tmp_path: Path):
    """A launch that finds a pid file takes it for its job only when the process there is this run's wrapper
    (its own environment carries the run's mark); any other process of this user is left alone."""
    root = tmp_path / "work" / "runs" / "12"
    (root / ".orch").mkdir(parents=True)
    (root / ".orch" / "token").write_text("t12")
    victim = subprocess.Popen(["sleep", "300"])
    try:
        (root / ".orch" / "pid").write_text(f"{victim.pid} {procs.start_time(victim.pid)}\n")
        with pytest.raises(AgentError, match=f"names process {victim.pid}, which is not this run's wrapper"):
            link.call("launch", dir=str(root), script="true\n", token="t12")
        assert link.call("find", dir=str(root))["job"] is None  # nor is it picked up by a controller starting over
        assert victim.poll() is None
        # a wrapper of another run, of this user, is not this run's either
        other = tmp_path / "work" / "runs" / "13"
        theirs = link.call("launch", dir=str(other), script="sleep 300\n", token="t13")
        (root / ".orch" / "pid").write_text(f"{theirs['pid']} {theirs['start']}\n")
        with pytest.raises(AgentError, match="not this run's wrapper"):
            link.call("launch", dir=str(root), script="true\n", token="t12")
        assert link.call("kill", pid=theirs["pid"], start=theirs["start"], grace_s=1)["outcome"] != "gone"
    finally:
        victim.kill()
        victim.wait()


def test_a_run_dir_reached_through_a_folder_of_another_user_is_refused(link: AgentLink, tmp_path: Path):
    """Every folder from the workdir's runs/ down is this user's (runs/ itself: root's, or sticky), none
    a link; a runs/ others may write in is made sticky, a run dir of this user's writable by others is made
    its own alone."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another user")
    runs = tmp_path / "work" / "runs"
    (runs / "key").mkdir(parents=True)
    runs.chmod(0o2775)
    os.chown(runs / "key", 61234, -1)
    with pytest.raises(AgentError, match=r"refusing .*/runs/key: it belongs to uid 61234"):
        link.call("launch", dir=str(runs / "key" / "1"), script="true\n", token="a")
    assert not (runs / "key" / "1").exists()
    (runs / "mine").mkdir(mode=0o777)
    (runs / "mine").chmod(0o777)
    link.call("launch", dir=str(runs / "mine" / "1"), script="true\n", token="b")
    assert runs.stat().st_mode & 0o7777 == 0o3775 and (runs / "mine").stat().st_mode & 0o777 == 0o755
    (runs / "link").symlink_to(runs / "mine")
    with pytest.raises(AgentError, match="symlink"):
        link.call("launch", dir=str(runs / "link" / "2"), script="true\n", token="c")
    os.chown(runs, 61234, -1)
    runs.chmod(0o2775)  # another user's, not sticky: anyone in the group could rename run dirs there
    with pytest.raises(AgentError, match="a shared runs/ must be sticky"):
        link.call("launch", dir=str(runs / "mine" / "3"), script="true\n", token="d")


def test_a_child_that_left_the_jobs_group_is_stopped_with_the_job(link: AgentLink, tmp_path: Path):
    """A job's child started with `setsid` is in a group of its own but carries the job's mark: `kill`
    stops it with the job; a process of the same user without the mark is left alone."""
    root = tmp_path / "work" / "runs" / "14"
    out = tmp_path / "stray.pid"
    job = link.call("launch", dir=str(root), script=f"setsid sh -c 'echo $$ > {out}; exec sleep 300' &\nsleep 300\n",
                    token="t14")
    wait_for(lambda: out.exists() and out.read_text().strip().isdigit())
    stray = int(out.read_text())
    wait_for(lambda: procs._stat_fields(stray)[2] == str(stray))  # its own group
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        assert link.call("kill", pid=job["pid"], start=job["start"], grace_s=5)["outcome"] in ("stopped", "killed")
        wait_for(lambda: not procs.live_start(stray))
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


# -- the file the job writes, whatever becomes of its name -----------------------------------------------
def _followed_to_exit(link: AgentLink, tmp_path: Path, run: str, script: str) -> tuple[bytes, dict]:
    root = str(tmp_path / "work" / "runs" / run)
    job = link.call("launch", dir=root, script=script, token=f"tok-{run}")
    link.tell("follow", key=run, dir=root, pid=job["pid"], start=job["start"], offset=0)
    got = states(link, run, lambda s: s[-1]["exit_code"] is not None and s[-1]["offset"] + len(
        s[-1]["data"]) >= s[-1]["size"])
    return log_of(got), got[-1]


def test_a_log_renamed_out_of_its_run_dir_mid_run_loses_no_line(link: AgentLink, tmp_path: Path):
    away = tmp_path / "away"
    away.mkdir()
    script = (f"for i in $(seq 50); do echo sample $i; done\nsleep 0.3\nmv log {away}/log\n"
              "for i in $(seq 51 200); do echo sample $i; sleep 0.002; done\n")
    data, last = _followed_to_exit(link, tmp_path, "r1", script)
    assert last["exit_code"] == 0
    assert data.decode().split() == [w for i in range(1, 201) for w in ("sample", str(i))]


@pytest.mark.parametrize("kind", ["symlink", "fifo", "device"])
def test_a_log_replaced_by_a_symlink_fifo_or_device_is_refused_and_the_jobs_file_read(
        link: AgentLink, tmp_path: Path, kind: str):
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"NOT THE JOB\n" * 1000)
    replace = {"symlink": f"ln -s {decoy} log", "fifo": "mkfifo log", "device": "ln -s /dev/zero log"}[kind]
    script = f"echo before\nsleep 0.3\nrm log\n{replace}\necho after\necho done\n"
    data, last = _followed_to_exit(link, tmp_path, f"k-{kind}", script)
    assert data == b"before\nafter\ndone\n" and last["exit_code"] == 0


def test_a_fifo_as_log_never_blocks_tail_chunk_or_a_read(link: AgentLink, tmp_path: Path):
    root = tmp_path / "work" / "runs" / "fifo"
    root.mkdir(parents=True)
    os.mkfifo(root / "log")  # opened to read, it would block until a writer came: none ever does
    assert link.call("tail", path=str(root / "log"), lines=5) == {"text": "", "size": 0}
    assert link.call("chunk", path=str(root / "log"), offset=0, length=100) == {"data": b""}
    assert link.call("read", dir=str(root), offset=0)["data"] == b""
