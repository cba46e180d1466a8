"""What a person watching a run sees: one line drawn anew every second, or a plain line now and then.

The line is made from the run's record and the clock, so it moves between polls: the ETA counts down
from when the bar last moved, elapsed time goes on, and news older than a few seconds says how old it is.
"""

from __future__ import annotations

import time
from typing import Any

from ..store.record import RunRecord

BAR = 24
STALE_S = 5.0  # news older than this is said to be so
PLAIN_EVERY_S = 30.0  # off a terminal: a progress line this often, or when the phase changes


def duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def progress_text(progress: dict[str, Any] | None, phase: str | None, since_s: float = 0.0) -> str:
    """`phase label [bar] pct done/total rate eta`; the ETA less the seconds since it was printed."""
    p = progress or {}
    phase = phase or "?"
    if not p:
        return phase
    total = p.get("total")
    frac = (p["done"] / total) if total else None
    bar = ""
    if frac is not None:
        filled = int(BAR * min(max(frac, 0), 1))
        bar = "█" * filled + "░" * (BAR - filled) + f" {100 * frac:5.1f}% "
    eta = f" eta {duration(p['eta_s'] - since_s)}" if p.get("eta_s") is not None else ""
    rate = f" {p['rate_per_s']:.2f}/s" if p.get("rate_per_s") else ""
    done = f"{p['done']:g}/{total:g}" if total else f"{p['done']:g}"
    return f"{phase} {p.get('label') or ''} {bar}{done}{rate}{eta}".replace("  ", " ")


def line(run: RunRecord, now: float) -> str:
    since_bar = now - run.progress_at if run.progress_at else 0.0
    parts = [progress_text(run.progress, run.phase, since_bar)]
    if run.started_at:
        parts.append(duration(now - run.started_at))
    if run.last_line:
        parts.append(run.last_line[:80])
    if run.heartbeat and now - run.heartbeat > STALE_S:
        parts.append(f"no news for {now - run.heartbeat:.0f} s")
    return " · ".join(parts)


class RunView:
    """A Rich renderable of the run's live line; `update` gives it the newest record."""

    def __init__(self, run: RunRecord | None = None, clock: Any = time.time):
        self.run, self.clock = run, clock

    def update(self, run: RunRecord) -> None:
        self.run = run

    def __rich__(self) -> Any:
        from rich.text import Text

        return Text(line(self.run, self.clock()) if self.run else "starting", no_wrap=True, overflow="ellipsis")


class PlainProgress:
    """Off a terminal (cron, CI, a pipe): the live line when the phase changes, else every PLAIN_EVERY_S."""

    def __init__(self, write: Any, clock: Any = time.time):
        self.write, self.clock = write, clock
        self.phase: str | None = None
        self.last = 0.0

    def update(self, run: RunRecord) -> None:
        now = self.clock()
        if run.phase != self.phase or now - self.last >= PLAIN_EVERY_S:
            self.phase, self.last = run.phase, now
            self.write(line(run, now))
