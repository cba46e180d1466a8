"""Which orch process controls something (a run's watch, a lease, a sweep), and whether it still lives.

One encoding everywhere: `hostname:pid:start`, the start time in clock ticks from /proc so a reused pid
is never taken for the controller. On this machine liveness is asked of the kernel; a controller on
another machine (a shared database) is alive while its heartbeat is recent.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

# A controller elsewhere is taken for dead after this many of its longest poll intervals without a heartbeat.
STALE_FACTOR = 3.0


def hostname() -> str:
    import socket  # on first use: every orch command imports this module, few ask who they are

    return socket.gethostname()


def process_start(pid: int) -> str | None:
    """Start time of a local process (clock ticks since boot), so a reused pid is not taken for it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


def pid_alive(pid: int, start: str | None = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return True  # no /proc to ask (another OS): the signal said it exists
    if fields[0] == "Z":  # a zombie: dead, unreaped where nothing reaps orphans (a container's init)
        return False
    return start is None or fields[19] == start


@dataclass(frozen=True)
class Controller:
    hostname: str
    pid: int
    start: str | None = None

    @classmethod
    def me(cls) -> Controller:
        return cls(hostname(), os.getpid(), process_start(os.getpid()))

    @classmethod
    def parse(cls, text: str | None) -> Controller | None:
        """`hostname:pid:start` (or the older `hostname:pid`); None for an empty or unreadable value."""
        parts = (text or "").split(":")
        if len(parts) == 2:
            parts.append("")
        if len(parts) != 3 or not parts[1].isdigit():
            return None
        hostname, pid, start = parts
        return cls(hostname, int(pid), start or None)

    def __str__(self) -> str:
        return f"{self.hostname}:{self.pid}:{self.start or ''}"

    def same_process(self, other: Controller | None) -> bool:
        """The same process (a start time missing on either side does not tell them apart)."""
        if other is None or (self.hostname, self.pid) != (other.hostname, other.pid):
            return False
        return self.start is None or other.start is None or self.start == other.start

    @property
    def is_local(self) -> bool:
        return self.hostname == hostname()

    @property
    def is_mine(self) -> bool:
        return self.same_process(Controller.me())

    def alive(self, heartbeat: float | None, stale_after_s: float, now: float | None = None) -> bool:
        """On this machine: the process exists. Elsewhere: it wrote a heartbeat within `stale_after_s`."""
        if self.is_local:
            return pid_alive(self.pid, self.start)
        return heartbeat is not None and (now if now is not None else time.time()) - heartbeat < stale_after_s
