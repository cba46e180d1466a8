"""Leases: a host, or a set of its GPUs, is held by at most one run at a time.

Which is the truth: the host. Whether a run's job can still use the GPUs is what its host can prove —
its wrapper alive, its run dir's exit code — and, across workspaces, the host's lease files
(host/hostlease.py) are what every workspace sees. This table is one workspace's record of it: what keeps
that workspace's runs apart without a round trip, taken in one `BEGIN IMMEDIATE` transaction together
with the run's row, so two runs of one workspace never both get the host.

A lease names its run and the controller process that took it (pid with its start time, hostname). It is
dropped once the run has ended and the end steps that must precede the next run are done
(BEFORE_RELEASE). Controller heartbeats (`holder_alive`) only say whether someone is still at work on
the run; they never free a lease by themselves. A holder nobody is at work on is handed to the run
flow's probe, which asks the host: it ends a run that never launched, polls a launched one once — its
lease is freed only once its job is seen to have ended — and frees the lease of a run that ended while
whoever ended it died only once the host shows its job is not running. Two runs never share GPUs, and a
host is never blocked past the end of its job.
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

# The probe hands a run whose controller died to the run flow, which ends it if its job is over.
Probe = Callable[[RunRecord], None]

# The end steps that come before the host's next run: its metrics cover the whole log, and a next run's
# patches need the install reverted. The run flow frees the lease right after them (see runflow.finish);
# an ended run's lease found before they are done stays while whoever does them is alive.
BEFORE_RELEASE = ("log to end", "patch revert")


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


def acquire(store: Store, host: str, gpus: list[int] | None, create_run: Callable[[], int], poll_max: float,
            probe: Probe | None = None) -> int:
    """`acquire_all` for a run on one host: its id."""
    return acquire_all(store, [host], gpus, lambda: [create_run()], poll_max, probe)[0]


def acquire_all(store: Store, hosts: Sequence[str], gpus: list[int] | None, create_runs: Callable[[], list[int]],
                poll_max: float, probe: Probe | None = None) -> list[int]:
    """Create the run's records (create_runs: one per host, in the order of `hosts`) and a lease on each host
    in one transaction, or raise Busy naming a holder: all or none, so a run across several hosts never
    holds some while it waits for others, and two such runs never wait for each other.

    Holders whose run ended with its end steps before release done are dropped. Holders nobody is at work
    on are handed to `probe` (outside the transaction: it asks the host), which frees their lease only once
    the host shows their job over; without a probe, an ended run's lease goes on the record's word.
    """
    probed: set[int] = set()
    while True:
        orphans: list[RunRecord] = []
        busy: Busy | None = None
        with store.tx() as c:
            for lease in [held_one for host in sorted(hosts) for held_one in held(store, host)]:
                if not overlaps(lease.gpus, gpus):
                    continue
                run: RunRecord | None
                try:
                    run = store.get_run(lease.run_id)
                except NotFound:
                    run = None
                if run is None or (run.status.terminal and (steps_before_release_done(store, run) or (
                        probe is None and not holder_alive(lease, run)))):
                    c.execute("DELETE FROM leases WHERE id = ?", (lease.id,))  # its run ended; nobody dropped it
                    continue
                if run.status.terminal:  # its log is being read to the end or its patches reverted: a moment
                    busy = busy or Busy(lease, run)
                    if not holder_alive(lease, run) and run.id not in probed:
                        orphans.append(run)  # whoever ended it died: the host says whether its job is over
                    continue
                if holder_alive(lease, run):
                    busy = busy or Busy(lease, run)
                    continue
                busy = busy or Busy(lease, run, controller_gone=True)
                if run.id not in probed:
                    orphans.append(run)
            if busy is None:
                run_ids = create_runs()
                me = Controller.me()
                for host, run_id in zip(hosts, run_ids, strict=True):
                    c.execute(
                        "INSERT INTO leases (host, gpus, run_id, pid, pid_start, hostname, heartbeat, poll_max,"
                        " created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (host, dump_json(sorted(gpus) if gpus is not None else None), run_id, me.pid, me.start,
                         me.hostname, time.time(), poll_max, time.time()),
                    )
                return run_ids
        if not orphans or probe is None:
            raise busy
        for run in orphans:
            probed.add(run.id)
            probe(run)


def take(store: Store, hosts: Sequence[str], gpus: list[int] | None, create_runs: Callable[[], list[int]],
         poll_max: float, *, retry_s: float, probe: Probe | None = None, queue: bool = False,
         on_wait: Callable[[Busy], None] | None = None, sleep: Callable[[float], None] = time.sleep) -> list[int]:
    """`acquire_all`; with queue, wait (asking again every retry_s) until the holders are gone."""
    while True:
        try:
            return acquire_all(store, hosts, gpus, create_runs, poll_max, probe)
        except Busy as busy:
            if not queue:
                raise
            if on_wait is not None:
                on_wait(busy)  # may raise to give up waiting
            sleep(retry_s)


def release(store: Store, run_id: int) -> None:
    with store.tx() as c:
        c.execute("DELETE FROM leases WHERE run_id = ?", (run_id,))


def adopt(store: Store, run_id: int) -> None:
    """This process now controls the run (a resumed sweep watching a run its dead controller started)."""
    me = Controller.me()
    with store.tx() as c:
        c.execute("UPDATE leases SET pid = ?, pid_start = ?, hostname = ?, heartbeat = ? WHERE run_id = ?",
                  (me.pid, me.start, me.hostname, time.time(), run_id))


__all__ = ["Busy", "Lease", "acquire", "acquire_all", "adopt", "held", "holder_alive", "release", "take"]
