"""How a watcher polls: its options, and the backoff between polls (a tenacity wait strategy)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import tenacity

from ..host.health import HealthCheck
from ..store.record import KILL_GRACE_S


@dataclass
class WatchOptions:
    poll_min: float
    poll_max: float
    until_ready: bool = False
    ready_pattern: str | None = None
    engine: str | None = None
    stall_factor: float = 5.0
    on_stall: str = "warn"  # warn | kill | dump
    kill_grace_s: float = KILL_GRACE_S
    health: HealthCheck | None = None  # a server's endpoint, asked while it is ready; see health.py
    give_up_s: float | None = None  # a host silent for this long: the run ends lost


class PollWait(tenacity.wait.wait_base):
    """Tenacity wait strategy with a streak that resets on progress and a cap at the predicted finish."""

    def __init__(self, lo: float, hi: float, clock: Callable[[], float]):
        self.lo, self.hi, self.clock = lo, hi, clock
        self.streak = 0
        self.finish_at: float | None = None  # epoch seconds the job is predicted to finish
        self.look_again_at: float | None = None  # a poll no later than this, whatever the backoff
        self.immediate = False

    def reset(self) -> None:
        self.streak = 0

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self.next_interval()

    def next_interval(self) -> float:
        """Seconds until the next look; each call lengthens the streak."""
        if self.immediate:
            return 0.0
        interval = min(self.hi, self.lo * 2**self.streak)
        self.streak += 1
        if self.finish_at is not None:
            interval = min(interval, max(0.0, self.finish_at - self.clock()) + self.lo)
        if self.look_again_at is not None:
            interval = min(interval, max(0.0, self.look_again_at - self.clock()))
        return max(interval, 0.0)
