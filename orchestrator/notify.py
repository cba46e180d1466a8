"""Notifications: a small JSON document POSTed to the spec's `notify` URLs when a run or a sweep ends.

Sending never blocks or fails the run: it happens in a daemon thread with a bounded total time, retried
by the named policy `notify_retry`; what finally fails is recorded as a `warning` event. `drain()` lets
the command wait (bounded) for sends still in flight before the process exits.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import tenacity

TOTAL_S = 30.0  # default bound on all attempts of one send
ATTEMPT_S = 5.0  # per HTTP attempt

_pending: list[threading.Thread] = []
_pending_lock = threading.Lock()


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


def post(url: str, document: dict[str, Any], timeout: float = ATTEMPT_S) -> None:
    body = json.dumps(document, default=str).encode()
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", "User-Agent": "orch"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        raise NotifyError(f"HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
        reason = getattr(exc, "reason", exc)
        raise NotifyError(str(reason) or type(exc).__name__) from None


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


def send(urls: list[str], document: dict[str, Any], on_error: Callable[[str, str], None],
         total_s: float = TOTAL_S, sleep: Callable[[float], None] = time.sleep) -> threading.Thread:
    """Deliver to every URL in a daemon thread; on_error(url, message) for each one that failed."""

    def work() -> None:
        for url in urls:
            try:
                deliver(url, document, total_s, sleep)
            except NotifyError as exc:
                on_error(url, str(exc))
            except Exception as exc:  # noqa: BLE001 - a notification must never take anything else down
                on_error(url, f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=work, name="orch-notify", daemon=True)
    thread.start()
    with _pending_lock:
        _pending[:] = [t for t in _pending if t.is_alive()] + [thread]
    return thread


def drain(timeout: float = TOTAL_S) -> None:
    """Wait, at most `timeout` seconds in all, for sends still in flight (at the end of a command)."""
    deadline = time.monotonic() + timeout
    with _pending_lock:
        threads = list(_pending)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
