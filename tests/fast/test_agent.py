"""The host agent's protocol and its host-side logic, over a pipe to a real agent process (no sshd)."""

from __future__ import annotations

import base64
import json
import queue
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator import agent as agent_client
from orchestrator.agent import AgentError, AgentLink, Push
from orchestrator.executor import pushed_state
from orchestrator.hostjobs import agent as host_agent
from orchestrator.hosts import Host
from orchestrator.transport import LocalTransport


@pytest.fixture
def link(tmp_path: Path):
    host = Host(name="local", workdir=str(tmp_path / "work"), python=sys.executable)
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
    return b"".join(base64.b64decode(p["data"]) for p in pushes)


def test_hello_is_the_placed_version_and_the_file_is_content_addressed(link: AgentLink, tmp_path: Path):
    assert link.info["sha256"] == agent_client.digest()
    assert link.info["pid"] != os.getpid()
    placed = [p.name for p in (tmp_path / "work" / "runs" / "hostjobs").iterdir()]
    assert placed == [f"agent-{agent_client.digest()[:16]}.py"]


def test_a_launched_job_is_followed_to_its_exit_with_every_byte(link: AgentLink, tmp_path: Path):
    root = str(tmp_path / "work" / "runs" / "1")
    script = "for i in $(seq 50); do echo line $i; sleep 0.01; done\nprintf 'no newline at the end'\nexit 3\n"
    job = link.call("launch", dir=root, script=script, token="tok-1")
    assert job["pid"] > 0 and job["start"].isdigit() and not job["again"]
    link.tell("follow", key="1", dir=root, pid=job["pid"], start=job["start"], offset=0)
    got = states(link, "1", lambda s: s[-1]["exit_code"] is not None and s[-1]["offset"] + len(
        base64.b64decode(s[-1]["data"])) >= s[-1]["size"])
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
    members = host_agent.group_pids(job["pid"])
    assert len(members) >= 2
    # a start time that is not the process's: nothing is signalled
    assert link.call("kill", pid=job["pid"], start=str(int(job["start"]) + 1), grace_s=1)["outcome"] == "gone"
    assert all(host_agent.live_start(m) for m in members)
    assert link.call("kill", pid=job["pid"], start=job["start"], grace_s=5)["outcome"] == "stopped"
    deadline = time.monotonic() + 5
    while any(host_agent.live_start(m) for m in members):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_members_outliving_their_wrapper_are_the_jobs_only_with_its_mark(tmp_path: Path):
    proc = subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
    try:
        start = host_agent.start_time(proc.pid)
        assert host_agent.ours(proc.pid, start) == "group"
        assert host_agent.ours(proc.pid, str(int(start) + 5)) is None  # another process at that pid
        assert host_agent.ours(proc.pid, "") is None  # no start time: nothing is provably the job
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
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
    while host_agent.live_start(pid):
        assert time.monotonic() < deadline, "the agent outlived its channel"
        time.sleep(0.05)


def test_an_agent_file_swapped_on_the_host_is_never_run_but_placed_again(tmp_path: Path):
    host = Host(name="local", workdir=str(tmp_path / "w"), python=sys.executable)
    transport = LocalTransport(host)
    AgentLink.start(transport).close()
    placed = Path(agent_client.remote_path(transport))
    marker = tmp_path / "swapped-code-ran"
    placed.write_text(f"open({str(marker)!r}, 'w').close()\n" + placed.read_text())
    link = AgentLink.start(transport)
    link.close()
    assert not marker.exists()
    assert placed.read_bytes() == agent_client.source()


# -- the log, followed by the host-side logic itself -----------------------------------------------
def follow(root: Path, **req) -> host_agent.Followed:
    return host_agent.Followed({"key": "9", "dir": str(root), **req})


def drain(f: host_agent.Followed) -> bytes:
    out = b""
    for _ in range(10_000):
        doc = f.state(time.monotonic())
        if doc is None:
            return out
        out += base64.b64decode(doc["data"])
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
    monkeypatch.setattr(host_agent, "CHUNK", 1 << 16)
    (tmp_path / "log").write_bytes(b"z" * (5 << 20))  # 5 MiB, no newline
    f = follow(tmp_path)
    sizes = []
    while (doc := f.state(time.monotonic())) is not None:
        sizes.append(len(base64.b64decode(doc["data"])))
    assert sum(sizes) == 5 << 20 and max(sizes) == 1 << 16


def test_quiet_runs_push_nothing_until_poked(tmp_path: Path):
    (tmp_path / "log").write_bytes(b"hello\n")
    f = follow(tmp_path)
    assert f.state(0.0) is not None
    assert f.state(1.0) is None
    f.wanted = True
    doc = f.state(2.0)
    assert doc is not None and doc["data"] == "" and doc["offset"] == 6


def test_the_protocol_is_json_lines(tmp_path: Path):
    """Spoken by hand: a request line in, a reply line out, whatever else the agent pushes meanwhile."""
    proc = subprocess.Popen([sys.executable, "-u", host_agent.__file__], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b'{"id": 7, "op": "hello"}\n')
    proc.stdin.flush()
    reply = json.loads(proc.stdout.readline())
    assert reply["id"] == 7 and reply["ok"] and reply["result"]["sha256"] == agent_client.digest()
    proc.stdin.close()
    assert proc.wait(timeout=10) == 0
