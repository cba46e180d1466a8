"""How often orch looks: a host's poll bounds, the backoff between looks at a quiet run (a tenacity wait
strategy the host's watcher paces them with), and every other pace derived from them (a cluster's queue
query, a followed log, a wait for a busy host)."""

from __future__ import annotations

from collections.abc import Callable

import tenacity

from ..config.hosts import Host

BUSY_WAIT_MAX_S = 5.0  # a start waiting for a busy host asks again at least this often


def default_poll(host: Host) -> tuple[float, float]:
    """The host's poll bounds as its inventory entry sets them, else: SSH hosts 30 s → 600 s; the local host
    1 s → 10 s, since a poll costs nothing there."""
    lo, hi = (1.0, 10.0) if host.is_local else (30.0, 600.0)
    return (host.poll_min or lo, host.poll_max or hi)


def poll_bounds(host: Host, poll_min: float | None = None, poll_max: float | None = None) -> tuple[float, float]:
    """A run's poll bounds: its spec's where it sets them, else its host's; never a maximum under the minimum."""
    lo, hi = default_poll(host)
    lo = poll_min or lo
    return lo, max(poll_max or hi, lo)


def queue_query_s(host: Host) -> float:
    """The shortest gap between two queries of a cluster's queue: a third of its shortest poll, 1 s to 10 s
    (a cluster polled from 30 s sees a job's end by the scheduler within 10 s)."""
    return min(max(default_poll(host)[0] / 3, 1.0), 10.0)


def next_look_s(wait: PollWait, host: Host, in_queue: bool) -> float:
    """When a host's watcher asks again about a quiet run whose news its agent pushes: on the backoff (a
    backlog comes by itself, pushed chunk after chunk); a job in a scheduler's queue at the queue's pace,
    since its leaving the queue is the scheduler's news, not its log's."""
    wait.immediate = False
    interval = wait.next_interval()
    return min(interval, queue_query_s(host)) if in_queue else interval


def follow_log_s(host: Host) -> float:
    """How often a log someone reads along is looked at: every second at most."""
    return min(default_poll(host)[0], 1.0)


def busy_wait_s(poll_min: float) -> float:
    """How long a start queued behind a busy host waits before asking again."""
    return min(poll_min, BUSY_WAIT_MAX_S)


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
