"""Notifications: a small JSON document POSTed to the spec's `notify` URLs when a run or a sweep ends.

Sending never blocks or fails the run: it happens in a daemon thread with a bounded total time, retried
by the named policy `notify_retry`; what finally fails is recorded as a `warning` event. Each attempt
ends by its deadline whatever the receiver does (a hung or trickling one is cut off), reads at most
MAX_BODY bytes of the answer and follows only redirects that keep the POST, to http(s) URLs on the same
host (http to https, another path or port: never to an address the receiver picks). `drain()`
lets the command wait (bounded) for sends still in flight before the process exits, and records those
it gives up on.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

import tenacity

from .. import state

TOTAL_S = 30.0  # default bound on all attempts of one send
ATTEMPT_S = 5.0  # per HTTP attempt
MAX_BODY = 64 * 1024  # nothing in a receiver's answer is used: the rest is never read
MAX_REDIRECTS = 3
KEEP_POST = (307, 308)  # 301/302/303 would turn the POST into a GET without the document

_pending_lock = threading.Lock()  # the sends in flight are the process's (orchestrator/state.py)


SUMMARY_METRICS = 3
SUMMARY_CHARS = 300


def summary(head: str, reason: str | None, metrics: dict[str, float]) -> str:
    """One line a person reads in a chat: what ended and how, why when it failed, its first metrics."""
    line = head + (f": {' '.join(reason.split())}" if reason else "")
    shown = " ".join(f"{k}={v:g}" for k, v in list(metrics.items())[:SUMMARY_METRICS])
    line += f" — {shown}" if shown else ""
    return line if len(line) <= SUMMARY_CHARS else line[:SUMMARY_CHARS - 1] + "…"


class NotifyError(Exception):
    """One attempt failed (HTTP status, refused, timed out)."""


def notify_retry(total_s: float = TOTAL_S, sleep: Callable[[float], None] = time.sleep,
                 attempts: int = 5) -> tenacity.Retrying:
    """The retry policy for notifications: exponential backoff, bounded by attempts and total time."""
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(NotifyError),
        # stop_before_delay: no backoff sleep may carry a send past its bound
        stop=tenacity.stop_after_attempt(attempts) | tenacity.stop_before_delay(total_s),
        wait=tenacity.wait_exponential(multiplier=0.5, max=8),
        sleep=sleep,
        reraise=True,
    )


class _Deadline:
    """Shuts the connection's socket at the deadline: socket timeouts bound each read, not the sum, so a
    receiver sending a byte a second would hold a plain client forever."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float):
        self.conn = conn
        self.fired = False
        self.timer = threading.Timer(seconds, self._cut)
        self.timer.daemon = True
        self.timer.start()

    def _cut(self) -> None:
        self.fired = True
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _exchange(url: str, body: bytes, deadline: float) -> tuple[int, str, str | None]:
    """One request: status, reason and Location of the answer."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise NotifyError(f"not an http(s) URL: {url!r}")
    left = deadline - time.monotonic()
    if left <= 0:
        raise NotifyError("timed out")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=left)
    guard = _Deadline(conn, left)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("POST", target, body, {"Content-Type": "application/json", "User-Agent": "orch"})
        resp = conn.getresponse()
        resp.read(MAX_BODY)
        return resp.status, resp.reason, resp.getheader("Location")
    except (OSError, http.client.HTTPException) as exc:
        if guard.fired or isinstance(exc, TimeoutError):
            raise NotifyError("timed out (no complete answer in time)") from None
        raise NotifyError(str(exc) or type(exc).__name__) from None
    finally:
        guard.timer.cancel()
        conn.close()


def post(url: str, document: dict[str, Any], timeout: float = ATTEMPT_S) -> None:
    """One attempt, redirects included, over within `timeout` seconds."""
    body = json.dumps(document, default=str).encode()
    deadline = time.monotonic() + timeout
    host = urlsplit(url).hostname
    for _ in range(MAX_REDIRECTS + 1):
        status, reason, location = _exchange(url, body, deadline)
        if status in KEEP_POST and location:
            target = urljoin(url, location)
            parts = urlsplit(target)
            if parts.scheme not in ("http", "https"):
                raise NotifyError(f"HTTP {status}: redirect to {target[:200]!r} refused (not http(s))")
            # The receiver chose where orch posts next: another host could be one only this machine
            # reaches (loopback, the private network, a cloud's metadata address).
            if parts.hostname != host:
                raise NotifyError(f"HTTP {status}: redirect to {target[:200]!r} refused (another host than the URL's)")
            url = target
            continue
        if 300 <= status < 400 and status != 304:
            raise NotifyError(f"HTTP {status} {reason}: redirect not followed (it would drop the POST)")
        if status >= 400:
            raise NotifyError(f"HTTP {status} {reason}")
        return
    raise NotifyError(f"more than {MAX_REDIRECTS} redirects")


def deliver(url: str, document: dict[str, Any], total_s: float = TOTAL_S,
            sleep: Callable[[float], None] = time.sleep) -> int:
    """POST with retries, within total_s; returns the number of attempts, raises NotifyError at the end."""
    deadline = time.monotonic() + total_s
    attempts = 0
    for attempt in notify_retry(total_s, sleep):
        with attempt:
            attempts += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise NotifyError(f"gave up after {total_s:g} s")
            post(url, document, timeout=min(ATTEMPT_S, left))
    return attempts


@dataclass
class _Send:
    """One send in flight: which URLs are still open, so that each failure is reported exactly once."""

    thread: threading.Thread
    on_error: Callable[[str, str], None]
    open_urls: list[str]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self, url: str, error: str | None) -> None:
        with self.lock:
            if url not in self.open_urls:
                return
            self.open_urls.remove(url)
        if error is not None:
            self.on_error(url, error)


def send(urls: list[str], document: dict[str, Any], on_error: Callable[[str, str], None],
         total_s: float = TOTAL_S, sleep: Callable[[float], None] = time.sleep) -> threading.Thread:
    """Deliver to every URL in a daemon thread; on_error(url, message) for each one that failed."""

    def work() -> None:
        for url in urls:
            try:
                deliver(url, document, total_s, sleep)
            except NotifyError as exc:
                sending.close(url, str(exc))
            except Exception as exc:  # noqa: BLE001 - a notification must never take anything else down
                sending.close(url, f"{type(exc).__name__}: {exc}")
            else:
                sending.close(url, None)

    sending = _Send(threading.Thread(target=work, name="orch-notify", daemon=True), on_error, list(urls))
    with _pending_lock:
        held = state.current()
        held.notify_sends = [p for p in held.notify_sends if p.thread.is_alive()] + [sending]
    sending.thread.start()
    return sending.thread


def drain(timeout: float = TOTAL_S) -> None:
    """Wait, at most `timeout` seconds in all, for sends still in flight (at the end of a command); a
    URL still open then is reported as not delivered, since the process is about to exit."""
    deadline = time.monotonic() + timeout
    with _pending_lock:
        pending: list[_Send] = list(state.current().notify_sends)
    for sending in pending:
        sending.thread.join(max(0.0, deadline - time.monotonic()))
    for sending in pending:
        if sending.thread.is_alive():
            for url in list(sending.open_urls):
                sending.close(url, f"not delivered: still sending when orch exited after {timeout:g} s")

