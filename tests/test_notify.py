"""Notifications against real HTTP servers on loopback: retries, a dead receiver, the run unaffected."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from orchestrator import notify
from orchestrator.errors import SpecError
from orchestrator.spec import RunSpec, load

from orchtest import FAST, Orch


class Receiver:
    """An HTTP server on 127.0.0.1 that answers 500 to the first `fail` POSTs, then 200."""

    def __init__(self, fail: int = 0):
        self.fail = fail
        self.bodies: list[dict] = []
        self.attempts = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
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
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

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


def test_retries_with_backoff_until_delivered(receiver):
    r = receiver(fail=2)
    slept: list[float] = []
    assert notify.deliver(r.url, {"run_id": 7}, sleep=slept.append) == 3
    assert r.attempts == 3 and r.bodies == [{"run_id": 7}]
    assert slept == [0.5, 1.0]


def test_gives_up_within_bound_and_reports(receiver, silent_url):
    always = receiver(fail=100)
    errors: list[tuple[str, str]] = []
    started = time.monotonic()
    thread = notify.send([silent_url, always.url], {"run_id": 1}, lambda u, m: errors.append((u, m)), total_s=1.0)
    assert time.monotonic() - started < 0.2  # the caller never waits
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 4  # about 1 s per URL
    assert [u for u, _ in errors] == [silent_url, always.url]
    assert "timed out" in errors[0][1] and "HTTP 500" in errors[1][1]
    assert 1 < always.attempts <= 5


def test_spec_accepts_only_http_urls():
    assert RunSpec(notify=["https://hooks.example/x", "http://127.0.0.1:9/y"]).notify
    for bad in ("ftp://x/y", "hooks.example/x", "http://", "http://a b/"):
        with pytest.raises(SpecError, match="not an http"):
            load(RunSpec, None, [f"notify=[{json.dumps(bad)}]"])


def test_run_end_is_announced_after_retries(tmp_path, receiver):
    r = receiver(fail=2)
    orch = Orch(tmp_path / "ws")
    res = orch("run", "command", "--set", "cmd=echo gen_throughput: 88.8", "--set",
               f'notify=["{r.url}"]', *FAST)
    assert res.returncode == 0, res.stderr
    assert r.attempts == 3 and len(r.bodies) == 1
    doc = r.bodies[0]
    assert doc["event"] == "run.ended" and doc["run_id"] == 1 and doc["status"] == "succeeded"
    assert doc["playbook"] == "command" and doc["host"] == "local" and doc["error_kind"] is None
    assert not [e for e in orch.status(1)["events"] if e["kind"] == "warning"]


def test_dead_receiver_never_holds_up_the_run(tmp_path, silent_url):
    orch = Orch(tmp_path / "ws")
    started = time.monotonic()
    res = orch("run", "command", "--set", "cmd=exit 3", "--set", f'notify=["{silent_url}"]',
               "--set", "notify_timeout_s=1", *FAST)
    assert res.returncode == 1 and time.monotonic() - started < 8
    doc = orch.status(1)
    assert doc["status"] == "failed"
    warnings = [e["message"] for e in doc["events"] if e["kind"] == "warning"]
    assert warnings and warnings[0].startswith(f"notify {silent_url}: ") and "timed out" in warnings[0]
    # the run was already recorded as ended before the notification gave up
    ended = doc["ended_at"]
    assert [e["ts"] for e in doc["events"] if e["kind"] == "warning"][0] - ended >= 0.9


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
        '[spec]\ncmd = "true"\npoll_min = 0.05\npoll_max = 0.3\n[matrix]\n"env.X" = ["1", "2"]\n')
    orch("sweep", "run", str(orch.root / "s.toml"), check=0)
    assert r.attempts == 2 and len(r.bodies) == 1
    doc = r.bodies[0]
    assert doc["event"] == "sweep.finished" and doc["sweep_id"] == 1 and doc["status"] == "succeeded"
    assert [p["status"] for p in doc["points"]] == ["succeeded", "succeeded"] and doc["counts"] == {"succeeded": 2}
