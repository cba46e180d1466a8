"""A server's health endpoint, asked on its host: is a `ready` server still answering?

The log says when a server is ready; only its HTTP endpoint says it still serves. The watcher asks a
`HealthWatch` once per poll while the job is ready: the first failed answer raises a `health` event
(the run stays running), answers that keep failing for the grace period end the run as failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import OrchError
from ..store import Store
from ..store.record import Status
from . import agent
from .remote import Transport

GRACE_S = 120.0  # how long a ready server may fail its health endpoint before the run fails
TIMEOUT_S = 5.0  # per request, unless the playbook's probe says otherwise
SERVING_PHASES = ("ready", "running")  # phases in which a server must answer

Probe = Callable[[Transport], "int | None"]


@dataclass(frozen=True)
class HealthCheck:
    """A server's probe and how long a ready server may fail it before the run fails."""

    ask: Probe
    grace_s: float = GRACE_S


def ask(transport: Transport, port: int, python: str = "", path: str = "/health",
        timeout_s: float = TIMEOUT_S) -> int | None:
    """The HTTP status code of http://127.0.0.1:PORT/PATH, asked by the host's agent on the host; None when
    nothing answered within `timeout_s`."""
    url = f"http://127.0.0.1:{int(port)}{path}"
    code = agent.call(transport, "health", timeout=timeout_s + 25, url=url, timeout_s=timeout_s)["code"]
    return code if isinstance(code, int) and code > 0 else None


def probe(port: int, python: str, path: str = "/health", timeout_s: float = TIMEOUT_S) -> Probe:
    """The health hook a playbook hands the watcher: `timeout_s` per request (an endpoint that does
    work, like SGLang's one-token generation, needs more than the default on a busy server)."""
    return lambda transport: ask(transport, port, python, path, timeout_s)


def describe(code: int | None) -> str:
    return "no answer" if code is None else f"HTTP {code}"


class HealthWatch:
    """Tracks one run's answers across polls; resumes from the run's `health` events after a restart."""

    def __init__(self, check: Probe, grace_s: float, store: Store, run_id: int):
        self.check, self.grace_s = check, grace_s
        self.ok = False  # the last answer was 200
        self.down_since: float | None = None
        self.answered = False  # a 200 was ever recorded
        for e in store.events(run_id):
            if e["kind"] == "health":
                data = e["data"] or {}
                self.down_since = data.get("down_since")
                self.answered = self.answered or bool(data.get("answered"))

    def poll(self, transport: Transport, now: float | None = None
             ) -> tuple[list[tuple[str, str, Any]], tuple[Status, str, dict[str, Any]] | None]:
        """Ask once: the events to record and, when the grace ran out, how the run ends."""
        now = time.time() if now is None else now
        try:
            code = self.check(transport)
        except OrchError:
            return [], None  # the host did not answer; the next poll finds out why
        self.ok = code == 200
        if self.ok:
            events: list[tuple[str, str, Any]] = []
            if self.down_since is not None:
                events.append(("health", f"health endpoint answering again after {now - self.down_since:.0f} s",
                               {"down_since": None, "answered": True}))
            elif not self.answered:
                events.append(("health", "health endpoint answered (HTTP 200)", {"answered": True}))
            self.down_since, self.answered = None, True
            return events, None
        if self.down_since is None:
            self.down_since = now
            message = f"health endpoint stopped answering ({describe(code)}); failing the run after {self.grace_s:g} s"
            return [("health", message, {"down_since": now, "code": code})], None
        down = now - self.down_since
        if down >= self.grace_s:
            why = f"health endpoint stopped answering for {down:.0f} s (last: {describe(code)})"
            return [], (Status.FAILED, why, {})
        return [], None


def ready(phase: str | None, answering: bool | None) -> bool:
    """The one rule for "the run is ready", which `--until-ready` waits for, whoever watches: its log says it
    serves (`ready`, or `running` when that moment fell between two reads) and, for a server with a health
    endpoint (`answering` not None), the endpoint answered when last asked."""
    return phase in SERVING_PHASES and answering is not False


def answering(events: list[dict[str, Any]]) -> bool:
    """Does the run's health endpoint answer, by the last `health` event recorded?"""
    for e in reversed(events):
        if e["kind"] == "health":
            data = e["data"] or {}
            return bool(data.get("answered")) and data.get("down_since") is None
    return False


__all__ = ["GRACE_S", "SERVING_PHASES", "HealthCheck", "HealthWatch", "answering", "ask", "probe", "ready"]
