"""Leases: a host, or a set of its GPUs, is held by at most one run at a time.

A lease names its run and the controller process that took it (pid with its start time, hostname).
It is taken in one `BEGIN IMMEDIATE` transaction together with the run's row, and dropped when the run
ends. A holder whose controller died is never trusted blindly either way: a run that never launched is
ended, and a launched one is polled once on its host — its lease is freed only once the job is seen to
have ended, so two runs never share GPUs, and a host is never blocked past the end of its job.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import NotFound, OrchError
from .lifecycle import Status, transition
from .remote import quote
from .store import Store

if TYPE_CHECKING:
    from .hosts import Host
    from .workspace import Workspace

# A controller on another machine is taken for dead after this many of its longest poll intervals
# without a heartbeat (the watcher writes runs.heartbeat on every poll).
STALE_FACTOR = 3.0


class Busy(OrchError):
    """The host or GPU set is held by another run."""

    def __init__(self, lease: Lease, controller_gone: bool = False):
        self.lease = lease
        who = f"pid {lease.pid} on {lease.hostname}"
        how = (f"its controller ({who}) is gone but the job still runs; `orch watch {lease.run_id}` follows it"
               if controller_gone else f"started by {who}")
        verb = "is" if lease.gpus is None else "are"
        super().__init__(f"{lease.describe()} {verb} busy with run {lease.run_id} ({how}); --queue waits")


@dataclass(frozen=True)
class Lease:
    id: int
    host: str
    gpus: list[int] | None  # None: the whole host
    run_id: int
    pid: int
    pid_start: str | None
    hostname: str
    heartbeat: float
    poll_max: float

    @property
    def key(self) -> str:
        return self.host if self.gpus is None else f"{self.host}:{','.join(map(str, self.gpus))}"

    def describe(self) -> str:
        return f"host {self.host}" if self.gpus is None else f"GPUs {','.join(map(str, self.gpus))} of {self.host}"


def overlaps(a: list[int] | None, b: list[int] | None) -> bool:
    return a is None or b is None or bool(set(a) & set(b))


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
    if start is None:
        return True
    now = process_start(pid)
    return now is None or now == start


def controller_alive(hostname: str, pid: int, start: str | None, heartbeat: float | None,
                     poll_max: float, now: float | None = None) -> bool:
    """On this machine: the process exists. Elsewhere: it wrote a heartbeat recently."""
    if hostname == socket.gethostname():
        return pid_alive(pid, start)
    return heartbeat is not None and (now or time.time()) - heartbeat < STALE_FACTOR * poll_max


def _holder_alive(lease: Lease, run: dict[str, Any]) -> bool:
    """The lease's controller, or whoever watches the run now (`orch watch` after a dead controller).

    This process's own one-off polls of an orphan (probe_orphan) also stamp the run as watched: they
    do not count, or the orphan would look alive for as long as this process waits on it.
    """
    watcher = run.get("watcher") or ""
    hostname, _, pid = watcher.rpartition(":")
    watched_by = (hostname, int(pid)) if pid.isdigit() else None
    beat = lease.heartbeat
    if watched_by == (lease.hostname, lease.pid):
        beat = max(beat, run.get("heartbeat") or 0)
    if controller_alive(lease.hostname, lease.pid, lease.pid_start, beat, lease.poll_max):
        return True
    if watched_by is None or watched_by in {(lease.hostname, lease.pid), (socket.gethostname(), os.getpid())}:
        return False
    return controller_alive(watched_by[0], watched_by[1], None, run.get("heartbeat"), lease.poll_max)


def _row(row: tuple) -> Lease:
    id_, host, gpus, run_id, pid, pid_start, hostname, heartbeat, poll_max = row
    return Lease(id_, host, json.loads(gpus) if gpus else None, run_id, pid, pid_start, hostname, heartbeat,
                 poll_max)


_COLUMNS = "id, host, gpus, run_id, pid, pid_start, hostname, heartbeat, poll_max"


def held(store: Store, host: str | None = None) -> list[Lease]:
    sql, args = f"SELECT {_COLUMNS} FROM leases", []
    if host is not None:
        sql, args = sql + " WHERE host = ?", [host]
    return [_row(r) for r in store.conn.execute(sql + " ORDER BY id", args)]


def acquire(store: Store, host: str, gpus: list[int] | None, create_run: Callable[[], int], poll_max: float,
            probe: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Create the run (create_run) and its lease in one transaction, or raise Busy naming the holder.

    Holders whose run ended are dropped; holders whose controller died are handed to `probe` (outside
    the transaction: it talks to the host), which ends them if their job is over.
    """
    probed: set[int] = set()
    while True:
        orphans: list[dict[str, Any]] = []
        busy: Busy | None = None
        with store.tx() as c:
            for lease in held(store, host):
                if not overlaps(lease.gpus, gpus):
                    continue
                try:
                    run = store.get_run(lease.run_id)
                except NotFound:
                    run = None
                if run is None or Status(run["status"]).terminal:
                    c.execute("DELETE FROM leases WHERE id = ?", (lease.id,))  # its run ended; nobody dropped it
                    continue
                if _holder_alive(lease, run):
                    busy = busy or Busy(lease)
                    continue
                busy = busy or Busy(lease, controller_gone=True)
                if run["id"] not in probed:
                    orphans.append(run)
            if busy is None:
                run_id = create_run()
                c.execute(
                    "INSERT INTO leases (host, gpus, run_id, pid, pid_start, hostname, heartbeat, poll_max,"
                    " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (host, json.dumps(sorted(gpus)) if gpus is not None else None, run_id, os.getpid(),
                     process_start(os.getpid()), socket.gethostname(), time.time(), poll_max, time.time()),
                )
                return run_id
        if not orphans or probe is None:
            raise busy
        for run in orphans:
            probed.add(run["id"])
            probe(run)


def take(store: Store, host: str, gpus: list[int] | None, create_run: Callable[[], int], poll: tuple[float, float],
         *, probe: Callable[[dict[str, Any]], None] | None = None, queue: bool = False,
         on_wait: Callable[[Busy], None] | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
    """`acquire`; with queue, wait (polling every poll[0] s, at most 5 s) until the holder is gone."""
    while True:
        try:
            return acquire(store, host, gpus, create_run, poll[1], probe)
        except Busy as busy:
            if not queue:
                raise
            if on_wait is not None:
                on_wait(busy)  # may raise to give up waiting
            sleep(min(poll[0], 5.0))


def release(store: Store, run_id: int) -> None:
    with store.tx() as c:
        c.execute("DELETE FROM leases WHERE run_id = ?", (run_id,))


def adopt(store: Store, run_id: int) -> None:
    """This process now controls the run (a resumed sweep watching a run its dead controller started)."""
    with store.tx() as c:
        c.execute("UPDATE leases SET pid = ?, pid_start = ?, hostname = ?, heartbeat = ? WHERE run_id = ?",
                  (os.getpid(), process_start(os.getpid()), socket.gethostname(), time.time(), run_id))


def settle_orphan(ws: Workspace, store: Store, run: dict[str, Any], host: Host) -> dict[str, Any]:
    """A run whose controller died: end it when it never launched, pick up its pid when the launch got
    that far; a running one is left as it is. Returns the run as it is now."""
    import playbooks

    from . import playbook as pbmod

    status = Status(run["status"])
    if status.terminal or status is Status.RUNNING:
        return run
    pb = playbooks.get(run["playbook"])
    ctx = pbmod.context_for(ws, store, pb, run, host)
    if status is Status.LAUNCHING and run["remote_dir"]:
        # the wrapper may have started: its pid file says so
        fields = ctx.transport.run(f"cat {quote(ctx.paths.pid)} 2>/dev/null || true", timeout=60).stdout.split()
        if len(fields) == 2 and fields[0].isdigit():
            transition(store, run["id"], Status.RUNNING, "picked up after its controller died",
                       pid=int(fields[0]), pid_start=fields[1])
            return store.get_run(run["id"])
        transition(store, run["id"], Status.LOST, "its controller died while launching; no job pid was written")
    else:
        transition(store, run["id"], Status.FAILED, f"its controller died before launch ({status})")
    pbmod.after_end(pb, ctx)
    return store.get_run(run["id"])


def probe_orphan(ws: Workspace, store: Store, run: dict[str, Any]) -> None:
    """Settle a run whose controller died and poll it once; if its job has ended, end it (which frees its lease)."""
    import playbooks

    from . import playbook as pbmod
    from .hosts import Inventory

    try:
        host = Inventory.load(ws.hosts_file, ws.root).get(run["host"])
        run = settle_orphan(ws, store, run, host)
        if Status(run["status"]) is not Status.RUNNING:
            return
        pb = playbooks.get(run["playbook"])
        ctx = pbmod.context_for(ws, store, pb, run, host)
        watcher = pbmod.Watcher(store, run["id"], ctx.transport, pbmod.watch_options(pb, ctx.spec, host))
        if watcher.poll_once() and Status(watcher.run["status"]).terminal:
            pbmod.after_end(pb, ctx)
    except OrchError as exc:  # the host cannot say: the lease stays, the caller reports the holder
        store.add_event(run["id"], "warning", f"lease check: {exc}")


__all__ = ["Busy", "Lease", "acquire", "adopt", "held", "probe_orphan", "release", "settle_orphan", "take"]
