"""Leases: a host, or a set of its GPUs, is held by at most one run at a time, and the host says which.

The host decides (host/hostlease.py): its lease files name the run that holds, and it grants a start's `take`
or refuses it naming the holder, for every workspace alike. This table is this workspace's memory of what
its hosts granted — which run, and the controller that took it (pid with its start time, hostname), for
the heartbeat that says whether someone is still at work on it — written in the transaction that creates
the run with the host's grant, dropped at release; it never decides who holds a host.

A refusal naming a run of this workspace (`HeldByRun`) is acted on here: the start waits (Busy) while
someone is at work on the holder, and a holder nobody is at work on, or one whose record says it ended with
its end steps before release done, is handed to the run flow's probe, which asks the host again: it ends a
run that never launched or whose job is over, and then releases it (on the host too); a job still running
keeps its host. Two runs never share GPUs, and a host is never blocked past the end of its job.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import NotFound, OrchError
from .controller import STALE_FACTOR, Controller
from .db import Store
from .encoding import dump_json, load_json
from .record import RunRecord

# The probe hands a holder nobody is at work on to the run flow, which ends and releases it if its job is over.
Probe = Callable[[RunRecord], None]

# The end steps that come before the host's next run: what lingers of a job that failed while running is
# stopped, its metrics cover the whole log, and a next run's patches need the install reverted. The run flow
# releases the lease right after them (see runflow.finish); until then its host holds it for the ended run
# (host/hostjobs/leases.ENDING_S at most).
BEFORE_RELEASE = ("stop", "log to end", "patch revert")
# A run that has ended holds its host only while its end steps run (the log's last read, the patch revert): a
# take waits for them this long, asked again every ENDING_POLL_S, rather than refuse a start a moment before the
# host is free.
ENDING_WAIT_S = 60.0
ENDING_POLL_S = 0.5


def steps_before_release_done(store: Store, run: RunRecord) -> bool:
    """Whether an ended run's end steps before release are done (each a `finished` event, or a warning
    naming it: a step that failed is over too)."""
    over = set()
    for e in store.events(run.id):
        if e["kind"] == "finished":
            over.add(e["message"])
        elif e["kind"] == "warning":
            over.add(e["message"].split(":", 1)[0])
    return all(name in over for name in BEFORE_RELEASE)


class Busy(OrchError):
    """The host or GPU set is held by another run."""

    def __init__(self, lease: Lease, holder: RunRecord | None = None, controller_gone: bool = False):
        self.lease = lease
        # a node of a run across hosts holds its own host: named as its run (the head), what a person acts on
        run_id = holder.parent_id if holder is not None and holder.parent_id is not None else lease.run_id
        who = f"pid {lease.controller.pid} on {lease.controller.hostname}"
        how = (f"its controller ({who}) is gone but the job still runs; `orch watch {run_id}` follows it"
               if controller_gone else f"started by {who}")
        verb = "is" if lease.gpus is None else "are"
        super().__init__(f"{lease.describe()} {verb} busy with run {run_id} ({how}); --queue waits")


@dataclass(frozen=True)
class Lease:
    id: int
    host: str
    gpus: list[int] | None  # None: the whole host
    run_id: int
    controller: Controller  # the process that took it
    heartbeat: float
    poll_max: float

    @property
    def key(self) -> str:
        return self.host if self.gpus is None else f"{self.host}:{','.join(map(str, self.gpus))}"

    def describe(self) -> str:
        return f"host {self.host}" if self.gpus is None else f"GPUs {','.join(map(str, self.gpus))} of {self.host}"


def overlaps(a: list[int] | None, b: list[int] | None) -> bool:
    return a is None or b is None or bool(set(a) & set(b))


def holder_alive(lease: Lease, run: RunRecord, now: float | None = None) -> bool:
    """Whether someone is still at work on the run: the lease's controller, or whoever watches the run now
    (`orch watch` after a dead controller). On this machine the kernel says so; elsewhere a recent
    heartbeat does. It says nothing of the job: a holder nobody is at work on goes to the probe, which
    asks the host.

    This process's own one-off polls of an orphan (the probe) also stamp the run as watched: they
    do not count, or the orphan would look alive for as long as this process waits on it.
    """
    stale_after = STALE_FACTOR * lease.poll_max
    watcher = run.watched_by
    beat = lease.heartbeat
    if lease.controller.same_process(watcher):
        beat = max(beat, run.heartbeat or 0)
    if lease.controller.alive(beat, stale_after, now):
        return True
    if watcher is None or lease.controller.same_process(watcher) or watcher.is_mine:
        return False
    return watcher.alive(run.heartbeat, stale_after, now)


def _row(row: tuple) -> Lease:
    id_, host, gpus, run_id, pid, pid_start, hostname, heartbeat, poll_max = row
    return Lease(id_, host, load_json(gpus) if gpus else None, run_id, Controller(hostname, pid, pid_start),
                 heartbeat, poll_max)


_COLUMNS = "id, host, gpus, run_id, pid, pid_start, hostname, heartbeat, poll_max"


def held(store: Store, host: str | None = None) -> list[Lease]:
    sql, args = f"SELECT {_COLUMNS} FROM leases", []
    if host is not None:
        sql, args = sql + " WHERE host = ?", [host]
    return [_row(r) for r in store.conn.execute(sql + " ORDER BY id", args)]


class HeldByRun(OrchError):
    """The host refused a take because a run of this workspace (`run_id`) holds what it asked for."""

    def __init__(self, run_id: int, message: str):
        super().__init__(message)
        self.run_id = run_id


# The hosts' answer to a start (runflow.starting.HostTake): called with the new runs' ids (in the order of the
# hosts) inside the transaction that creates them, it takes each host's lease files or raises — HeldByRun,
# or another workspace's holder — and then no run is made.
Claim = Callable[[list[int]], None]


def acquire(store: Store, host: str, gpus: list[int] | None, create_run: Callable[[], int], poll_max: float,
            probe: Probe, claim: Claim) -> int:
    """`acquire_all` for a run on one host: its id."""
    return acquire_all(store, [host], gpus, lambda: [create_run()], poll_max, probe, claim)[0]


def acquire_all(store: Store, hosts: Sequence[str], gpus: list[int] | None, create_runs: Callable[[], list[int]],
                poll_max: float, probe: Probe, claim: Claim) -> list[int]:
    """Create the run's records (create_runs: one per host, in the order of `hosts`) and take each host in one
    transaction (`claim`, the hosts' answer), or raise naming a holder: all or none, so a run across several
    hosts never holds some while it waits for others, and two such runs never wait for each other.

    A holder of this workspace is Busy while someone is at work on it. One nobody is at work on, or one ended
    with its end steps before release done (its release was lost), goes to `probe` once (outside the
    transaction: it asks the host), and the hosts are asked again. One that has ended while a live process
    runs its end steps is waited for, up to ENDING_WAIT_S.
    """
    probed: set[int] = set()
    ends_by = time.monotonic() + ENDING_WAIT_S
    while True:
        try:
            with store.tx() as c:
                run_ids = create_runs()
                claim(run_ids)
                me, now = Controller.me(), time.time()
                for host, run_id in zip(hosts, run_ids, strict=True):
                    # the host granted it: what this workspace remembered overlapping it is over
                    for old in held(store, host):
                        if overlaps(old.gpus, gpus):
                            c.execute("DELETE FROM leases WHERE id = ?", (old.id,))
                    c.execute(
                        "INSERT INTO leases (host, gpus, run_id, pid, pid_start, hostname, heartbeat, poll_max,"
                        " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (host, dump_json(sorted(gpus) if gpus is not None else None), run_id, me.pid, me.start,
                         me.hostname, now, poll_max, now),
                    )
                return run_ids
        except HeldByRun as refusal:
            busy, stale, ending = _judge(store, refusal, gpus, poll_max)
            if stale and refusal.run_id not in probed:
                probed.add(refusal.run_id)
                probe(store.get_run(refusal.run_id))
            elif ending and time.monotonic() < ends_by:
                wait_for_end_steps()
            else:
                raise busy from None


def _judge(store: Store, refusal: HeldByRun, gpus: list[int] | None, poll_max: float) -> tuple[Busy, bool, bool]:
    """The holder a host named, as a person is told of it; whether it is one for the probe: nobody is at work
    on it, or it ended with its end steps before release done; and whether it ended and a live process runs
    its end steps, which free the host within moments."""
    try:
        run = store.get_run(refusal.run_id)
    except NotFound:  # a run this workspace no longer has: the host's own rule frees it
        return Busy(_unknown(refusal, gpus, poll_max)), False, False
    remembered = [held_one for held_one in held(store, run.host) if held_one.run_id == run.id]
    taken = remembered[0] if remembered else _unknown(refusal, gpus, poll_max, run)
    alive = holder_alive(taken, run)
    if run.status.terminal:
        return Busy(taken, run), steps_before_release_done(store, run) or not alive, alive
    return Busy(taken, run, controller_gone=not alive), not alive, False


def wait_for_end_steps() -> None:
    """One pause of a take waiting for an ended holder's end steps."""
    time.sleep(ENDING_POLL_S)


def _unknown(refusal: HeldByRun, gpus: list[int] | None, poll_max: float, run: RunRecord | None = None) -> Lease:
    """A holder this workspace remembers no lease of (released here, not on its host): named by its record,
    its last watcher taken for the controller."""
    if run is None:
        return Lease(0, "?", gpus, refusal.run_id, Controller("?", 0), 0.0, poll_max)
    return Lease(0, run.host, gpus, run.id, run.watched_by or Controller("?", 0), run.heartbeat or 0.0, poll_max)


def granted_holder(store: Store, hosts: Sequence[str], gpus: list[int] | None) -> Busy | None:
    """The run of this workspace its hosts last granted what `gpus` asks of them and that has not released it
    (what a dry run, which asks no host, says a start would wait for), or None."""
    for host in sorted(hosts):
        for granted in held(store, host):
            if overlaps(granted.gpus, gpus):
                try:
                    return Busy(granted, store.get_run(granted.run_id))
                except NotFound:
                    continue
    return None


def release(store: Store, run_id: int) -> None:
    with store.tx() as c:
        c.execute("DELETE FROM leases WHERE run_id = ?", (run_id,))


def adopt(store: Store, run_id: int) -> None:
    """This process now controls the run (a resumed sweep watching a run its dead controller started)."""
    me = Controller.me()
    with store.tx() as c:
        c.execute("UPDATE leases SET pid = ?, pid_start = ?, hostname = ?, heartbeat = ? WHERE run_id = ?",
                  (me.pid, me.start, me.hostname, time.time(), run_id))


__all__ = ["Busy", "Claim", "HeldByRun", "Lease", "acquire", "acquire_all", "adopt", "granted_holder", "held", "holder_alive", "release"]
