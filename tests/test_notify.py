"""Notifications against real HTTP servers on loopback: retries, a dead receiver, the run unaffected."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest
from orchtest import FAST, Orch

from orchestrator.config.spec import RunSpec, load
from orchestrator.errors import SpecError
from orchestrator.runflow import notify


class Receiver:
    """An HTTP server on 127.0.0.1 that answers 500 to the first `fail` POSTs, then 200."""

    def __init__(self, fail: int = 0):
        self.fail = fail
        self.bodies: list[dict] = []
        self.attempts = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.attempts += 1
                if outer.attempts <= outer.fail:
                    self.send_response(500)
                else:
                    outer.bodies.append(json.loads(body))
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        # shutdown() waits for the loop to look again: every 0.5 s by default, at the end of every test
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(fail: int = 0) -> Receiver:
        made.append(Receiver(fail))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.fixture
def silent_url():
    """A port that accepts connections (kernel backlog) and never answers a byte."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
    sock.close()


class RawReceiver:
    """A TCP server on 127.0.0.1 that reads a request's head and then runs `answer(conn)`: for receivers
    that misbehave in ways http.server will not (trickling, endless bodies). Counts connections and bytes."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.sent = 0
        self.stop = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    head += chunk
                self.answer(self, conn)
            except OSError:  # the client hung up: what these tests want
                pass

    def write(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def trickle(r: RawReceiver, conn: socket.socket) -> None:
    """Headers a byte at a time, far inside any per-read timeout, never finishing."""
    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"a" * 10_000:
        if r.stop.is_set():
            return
        r.write(conn, bytes([byte]))
        time.sleep(0.2)


def endless_body(r: RawReceiver, conn: socket.socket) -> None:
    """A 3 GiB answer, sent until the client goes away (at most 256 MiB, so a greedy client still ends)."""
    r.write(conn, b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (3 << 30))
    block = b"x" * (1 << 20)
    while r.sent < 256 << 20 and not r.stop.is_set():
        r.write(conn, block)


def redirect_to(location: str):
    def answer(r: RawReceiver, conn: socket.socket) -> None:
        r.write(conn, f"HTTP/1.1 307 Temporary Redirect\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n"
                .encode())
    return answer


@pytest.fixture
def raw_receiver():
    made: list[RawReceiver] = []

    def make(answer) -> RawReceiver:
        made.append(RawReceiver(answer))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_a_trickling_receiver_is_cut_off_at_the_bound(raw_receiver):
    slow = raw_receiver(trickle)
    errors: list[tuple[str, str]] = []
    started = time.monotonic()
    thread = notify.send([slow.url], {"run_id": 1}, lambda u, m: errors.append((u, m)), total_s=1.5)
    thread.join(60)  # the receiver would trickle for half an hour; how close to the bound: bench/timeouts.py
    assert not thread.is_alive() and time.monotonic() - started >= 1.5
    assert errors and errors[0][0] == slow.url and "timed out" in errors[0][1]


def test_a_huge_answer_is_not_read(raw_receiver):
    big = raw_receiver(endless_body)
    assert notify.deliver(big.url, {"run_id": 1}, total_s=5) == 1
    time.sleep(0.2)  # what the receiver could still push into the socket buffers
    assert big.sent < 64 << 20, big.sent  # bounded by the kernel's buffers, not by the body


def test_redirects_keep_the_post_and_stay_on_http(receiver, raw_receiver):
    target = receiver()
    onward = raw_receiver(redirect_to(target.url))
    assert notify.deliver(onward.url, {"run_id": 3}, total_s=2) == 1
    assert target.bodies == [{"run_id": 3}]
    ftp = raw_receiver(lambda r, c: None)  # would see a connection if the redirect were followed
    away = raw_receiver(redirect_to(ftp.url.replace("http://", "ftp://")))
    with pytest.raises(notify.NotifyError, match="redirect to 'ftp://.*' refused"):
        notify.post(away.url, {"run_id": 4}, timeout=2)
    assert ftp.connections == 0 and away.connections == 1


@pytest.mark.parametrize("code", [307, 308])
@pytest.mark.parametrize("where", ["http://localhost:{port}/admin", "http://[::1]:{port}/admin",
                                   "http://169.254.169.254/latest/meta-data/", "https://10.0.0.1/internal"])
def test_a_redirect_to_another_host_is_not_followed(receiver, raw_receiver, code, where):
    """A receiver cannot send orch's POST on to an address of its choosing (this machine's loopback, the
    private network, a cloud's metadata address): only its own host's other URLs."""
    internal = receiver()  # a service only this machine reaches
    location = where.format(port=internal.url.split(":")[2].split("/")[0])

    def answer(r, conn):
        r.write(conn, f"HTTP/1.1 {code} Moved\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode())

    hook = raw_receiver(answer)
    with pytest.raises(notify.NotifyError, match=r"refused \(another host than the URL's\)"):
        notify.post(hook.url, {"run_id": 5}, timeout=2)
    assert internal.attempts == 0 and internal.bodies == []


def test_drain_is_bounded_and_says_what_it_gave_up(raw_receiver):
    slow = raw_receiver(trickle)
    errors: list[tuple[str, str]] = []
    notify.send([slow.url], {"run_id": 1}, lambda u, m: errors.append((u, m)), total_s=30)
    draining = threading.Thread(target=notify.drain, kwargs={"timeout": 0.5})
    draining.start()
    draining.join(60)  # the delivery alone would go on for 30 s
    assert not draining.is_alive()
    assert errors == [(slow.url, "not delivered: still sending when orch exited after 0.5 s")]


def test_a_trickling_receiver_never_holds_up_the_command(tmp_path, raw_receiver):
    slow = raw_receiver(trickle)
    orch = Orch(tmp_path / "ws")
    res = orch("run", "command", "--set", "cmd=true", "--set", f'notify=["{slow.url}"]',
               "--set", "notify_timeout_s=1", *FAST, timeout=60)  # the receiver trickles for half an hour
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    warnings = [e for e in doc["events"] if e["kind"] == "warning"]
    assert warnings and warnings[0]["message"].startswith(f"notify {slow.url}: ") and "timed out" in warnings[0]["message"]
    assert warnings[0]["ts"] - doc["ended_at"] < 20  # its own 1 s bound, not the default 30 s


def test_retries_with_backoff_until_delivered(receiver):
    r = receiver(fail=2)
    slept: list[float] = []
    assert notify.deliver(r.url, {"run_id": 7}, sleep=slept.append) == 3
    assert r.attempts == 3 and r.bodies == [{"run_id": 7}]
    assert slept == [0.5, 1.0]


def test_the_caller_never_waits(raw_receiver):
    """send returns while its delivery is still held by the receiver (which answers when the test says)."""
    answer = threading.Event()

    def held(r: RawReceiver, conn: socket.socket) -> None:
        answer.wait(60)
        r.write(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    hook = raw_receiver(held)
    errors: list[tuple[str, str]] = []
    thread = notify.send([hook.url], {"run_id": 1}, lambda u, m: errors.append((u, m)), total_s=30)
    assert thread.is_alive()
    answer.set()
    thread.join(60)
    assert not thread.is_alive() and errors == [] and hook.connections == 1


def test_gives_up_within_bound_and_reports(receiver, silent_url):
    always = receiver(fail=100)
    errors: list[tuple[str, str]] = []
    thread = notify.send([silent_url, always.url], {"run_id": 1}, lambda u, m: errors.append((u, m)), total_s=1.0,
                         sleep=lambda s: None)
    thread.join(60)  # the silent receiver never answers, the other always fails: the bound ends both
    assert not thread.is_alive()
    assert [u for u, _ in errors] == [silent_url, always.url]
    assert "timed out" in errors[0][1] and "HTTP 500" in errors[1][1]
    assert 1 <= always.attempts <= 5


def test_spec_accepts_only_http_urls():
    assert RunSpec(notify=["https://hooks.example/x", "http://127.0.0.1:9/y"]).notify
    for bad in ("ftp://x/y", "hooks.example/x", "http://", "http://a b/"):
        with pytest.raises(SpecError, match="not an http"):
            load(RunSpec, None, [f"notify=[{json.dumps(bad)}]"])


def test_run_end_is_announced_after_retries(tmp_path, receiver):
    r = receiver(fail=2)
    orch = Orch(tmp_path / "ws")
    res = orch("run", "command", "--set", "cmd=echo orch-metric gen_throughput=88.8", "--set",
               f'notify=["{r.url}"]', *FAST)
    assert res.returncode == 0, res.stderr
    assert r.attempts == 3 and len(r.bodies) == 1
    doc = r.bodies[0]
    assert doc["event"] == "run.ended" and doc["run_id"] == 1 and doc["status"] == "succeeded"
    assert doc["playbook"] == "command" and doc["host"] == "local" and doc["error_kind"] is None
    # the line a chat webhook shows
    assert doc["text"] == doc["content"] == "orch run 1 (command on local) succeeded — gen_throughput=88.8"
    assert not [e for e in orch.status(1)["events"] if e["kind"] == "warning"]


def test_dead_receiver_never_holds_up_the_run(tmp_path, silent_url):
    orch = Orch(tmp_path / "ws")
    res = orch("run", "command", "--set", "cmd=exit 3", "--set", f'notify=["{silent_url}"]',
               "--set", "notify_timeout_s=1", *FAST, timeout=60)  # the receiver never answers
    assert res.returncode == 1, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "failed"
    warnings = [e["message"] for e in doc["events"] if e["kind"] == "warning"]
    assert warnings and warnings[0].startswith(f"notify {silent_url}: ") and "timed out" in warnings[0]
    # the run was already recorded as ended before the notification gave up
    ended = doc["ended_at"]
    waited = next(e["ts"] for e in doc["events"] if e["kind"] == "warning") - ended
    assert 0.9 <= waited < 20  # its own 1 s bound, not the default 30 s; how close to 1 s: bench/timeouts.py


def test_bad_url_is_refused_before_anything_runs(tmp_path):
    orch = Orch(tmp_path / "ws")
    res = orch("run", "command", "--set", "cmd=true", "--set", 'notify=["file:///etc/passwd"]')
    assert res.returncode == 2 and "not an http(s) URL" in res.stderr
    assert not orch.db.exists() or orch.status() == []


def test_sweep_end_is_announced(tmp_path, receiver):
    r = receiver(fail=1)
    orch = Orch(tmp_path / "ws")
    (orch.root / "s.toml").write_text(
        f'name = "n"\nplaybook = "command"\nhosts = ["local"]\nnotify = ["{r.url}"]\n'
        'objective = { metric = "x", goal = "min" }\n'
        '[spec]\ncmd = "echo orch-metric x=$X"\npoll_min = 0.05\npoll_max = 0.3\n[matrix]\n"env.X" = ["2", "1"]\n')
    orch("sweep", "run", str(orch.root / "s.toml"), check=0)
    assert r.attempts == 2 and len(r.bodies) == 1
    doc = r.bodies[0]
    assert doc["event"] == "sweep.finished" and doc["sweep_id"] == 1 and doc["status"] == "succeeded"
    assert [p["status"] for p in doc["points"]] == ["succeeded", "succeeded"] and doc["counts"] == {"succeeded": 2}
    assert doc["text"] == "orch sweep 1 (n) succeeded: 2 succeeded; best env.X=1 (run 2) — x=1"


def test_the_summary_is_one_bounded_line():
    from orchestrator.runflow.notify import summary

    assert summary("orch run 3 (command on gpu01) failed", "exit code 3:\nTraceback  x", {}) == \
        "orch run 3 (command on gpu01) failed: exit code 3: Traceback x"
    long = summary("orch run 1 (command on h) failed", "y" * 1000, {"a": 1.5})
    assert len(long) == 300 and long.endswith("…") and "\n" not in long
