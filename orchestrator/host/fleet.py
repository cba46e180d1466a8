"""Talking to many hosts at once: one thread per host, each host bounded by its own timeout.

A host that does not answer in time is reported as unreachable and left behind; its thread is a
daemon, so neither the other hosts nor the end of the command wait for it (a thread pool's shutdown,
and the interpreter's exit, would).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import OrchError, Unreachable

if TYPE_CHECKING:
    from ..config.hosts import Host

T = TypeVar("T")
R = TypeVar("R")

MAX_PARALLEL = 32


def fan_out(items: dict[str, T], fn: Callable[[T], R], timeout: float,
            parallel: int = MAX_PARALLEL) -> dict[str, R | OrchError]:
    """fn(item) for every named item in parallel; each result, or the OrchError it raised, or an
    Unreachable when it took longer than `timeout` seconds (counted from its own start)."""
    results: dict[str, R | OrchError] = {}
    started: dict[str, float] = {}
    cond = threading.Condition()
    slots = threading.Semaphore(max(1, parallel))

    def work(name: str, item: T) -> None:
        with slots:
            with cond:
                started[name] = time.monotonic()
                cond.notify_all()
            try:
                value: R | OrchError = fn(item)
            except OrchError as exc:
                value = exc
            with cond:
                results.setdefault(name, value)
                cond.notify_all()

    for name, item in items.items():
        threading.Thread(target=work, args=(name, item), name=f"orch-{name}", daemon=True).start()
    with cond:
        while len(results) < len(items):
            now = time.monotonic()
            for name, t0 in started.items():
                if name not in results and now - t0 >= timeout:
                    results[name] = Unreachable(name, f"no answer within {timeout:g} s")
            waits = [t0 + timeout - now for n, t0 in started.items() if n not in results]
            if len(results) < len(items):
                cond.wait(max(0.01, min(waits)) if waits else 0.1)
    return {name: results[name] for name in items}


def check(hosts: list[Host], timeout: float,
          scheduler: Callable[[Host, float], str] | None = None) -> dict[str, dict[str, Any]]:
    """`orch hosts --check`: every host in parallel; per host ok, uname or error, seconds. A host's agent must
    start with its python and answer the handshake; a cluster's scheduler must answer too (`scheduler`:
    its probe, one more round trip)."""
    from .agent import AgentLink
    from .remote import connect, probe

    def one(host: Host) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            if host.scheduler:
                found: dict[str, Any] = {"ok": True, "uname": probe(host, timeout)}
                if scheduler is not None:
                    found["scheduler"] = scheduler(host, timeout)
            else:  # the agent's handshake is the round trip: it says the host's uname and python
                link = AgentLink.start(connect(host), timeout)
                found = {"ok": True, "uname": link.info.get("uname"), "python": link.info.get("python")}
                link.close()
            return {**found, "seconds": round(time.monotonic() - t0, 3)}
        except OrchError as exc:
            return {"ok": False, "error": str(exc), "seconds": round(time.monotonic() - t0, 3)}

    rounds = 2 if scheduler is not None and any(h.scheduler for h in hosts) else 1
    found = fan_out({h.name: h for h in hosts}, one, timeout * rounds + 1)  # +1: the probes' own timeouts first
    return {name: {"ok": False, "error": str(res), "seconds": timeout} if isinstance(res, OrchError) else res
            for name, res in found.items()}
