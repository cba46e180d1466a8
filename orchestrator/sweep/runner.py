"""The runner: one controller of one sweep, a thread per lane, each point started and watched through
the run flow, what each attempt came to decided by the retry policy and recorded on the point."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import runflow
from ..config.workspace import Workspace
from ..errors import OrchError
from ..host.executor import executor_class
from ..store import Store, lease
from ..store import sweeps as stored_sweeps
from ..store.record import RunRecord
from ..watch.follow import watch
from . import db, policy
from .plan import Plan, Point
from .policy import Action, Decision, Resume, Verdict
from .record import Fault, PointStatus

if TYPE_CHECKING:
    from .search import Searcher

HEARTBEAT_S = 5.0  # at most this often, a running sweep stamps its row on its watchers' polls


class Stopped(Exception):
    """The point was cancelled (sweep cancel or fail_fast) while it waited for its host."""


@dataclass(frozen=True)
class Attempt:
    """What one attempt of a point came to."""

    verdict: Verdict
    reason: str | None
    run_id: int | None = None

    @classmethod
    def of(cls, run: RunRecord) -> Attempt:
        v = policy.verdict(run)
        if v is Verdict.SUCCEEDED:
            return cls(v, None, run.id)
        if v in (Verdict.JOB, Verdict.SETUP):
            return cls(v, run.reason or "failed", run.id)
        if v is Verdict.CANCELLED:
            return cls(v, run.reason, run.id)
        return cls(v, run.reason or run.status.value, run.id)


class Runner:
    """A thread per lane (a host, or a GPU set of a host), one point at a time in each; a cluster's lane has
    up to max_parallel threads."""

    def __init__(self, ws: Workspace, p: Plan, sweep_id: int, echo: Callable[[str], None],
                 sleep: Callable[[float], None] = time.sleep, searcher: Searcher | None = None):
        self.ws, self.plan, self.sweep_id, self.echo, self.sleep = ws, p, sweep_id, echo, sleep
        self.search = searcher
        self.hosts = {h.name: h for h in p.hosts}
        self.errors: list[BaseException] = []
        self._beat = 0.0

    def run(self) -> None:
        if self.search is not None:
            threads = self._search_lanes(self.search)
        else:
            lanes: dict[str, deque[Point]] = {}
            for pt in self._order(self.plan.points):
                lanes.setdefault(pt.lane, deque()).append(pt)
            threads = [threading.Thread(target=self._lane, args=(_taking(pts),), name=f"sweep-{name}-{n}",
                                        daemon=True)
                       for name, pts in lanes.items() for n in range(self._width(pts))]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():  # short joins: Ctrl-C reaches the main thread
                    t.join(0.2)
        finally:
            if self.search is not None:
                self.search.stop()
        if self.errors:
            raise self.errors[0]

    def _search_lanes(self, searcher: Searcher) -> list[threading.Thread]:
        """A searching sweep's lanes: each host (each of its GPU sets, with search.gpu_sets; a cluster
        host max_parallel wide) asks for its next point when it is free."""
        assert self.plan.search is not None
        sets: list[list[int] | None] = list(self.plan.search.gpu_sets) or [None]
        threads = []
        for host in self.plan.hosts:
            cluster = executor_class(host).schedules_gpus
            for gpus in [None] if cluster else sets:
                for n in range((self.plan.file.max_parallel or 1) if cluster else 1):
                    where = host.name + (f":{','.join(map(str, gpus))}" if gpus else "")
                    threads.append(threading.Thread(target=self._lane, args=(searcher.lane(host, gpus),),
                                                    name=f"search-{where}-{n}", daemon=True))
        return threads

    def _width(self, points: deque[Point]) -> int:
        """How many threads take points from a lane: a host or GPU set runs one point at a time, a cluster
        as many as max_parallel (default: all, queued by the scheduler)."""
        if not points[0].cluster:
            return 1
        return min(self.plan.file.max_parallel or len(points), len(points))

    def _order(self, points: list[Point]) -> list[Point]:
        """Points whose runs a dead controller left going come first: a lane watches them again before it
        starts a new point, so a resumed cluster lane never runs more than its width."""
        store = Store(self.ws.db_path)
        try:
            live = {store.get_run(run_id).point for run_id in stored_sweeps.active_runs(store, self.sweep_id)}
        finally:
            store.close()
        return sorted(points, key=lambda pt: pt.key not in live)

    def _lane(self, points: Iterator[Point]) -> None:
        store = Store(self.ws.db_path)
        try:
            for pt in points:
                try:
                    self._point(store, pt)
                finally:
                    if self.search is not None:
                        self.search.ended(pt)
        except BaseException as exc:  # noqa: BLE001 - a bug: the main thread re-raises it
            self.errors.append(exc)
            if self.search is not None:
                self.search.stop()
        finally:
            store.close()

    # one point ---------------------------------------------------------------------------------
    def _point(self, store: Store, pt: Point) -> None:
        attempts = 0
        latest = db.latest_run(store, self.sweep_id, pt.key)
        if latest is not None:
            step = policy.resume(policy.verdict(latest))
            if step is Resume.KEEP:  # finished in an earlier session: never again
                self._keep(store, pt, latest)
                return
            if step is Resume.WATCH:
                ended, watched = self._resume(store, pt, latest)
                if not watched:  # it never launched: the point simply runs again
                    db.on_run_ended(store, self.sweep_id, pt.index, ended.id)
                else:
                    attempts = 1
                    if not self._settle(store, pt, self._ended(store, pt, ended), attempts):
                        return
                    self._backoff(store, pt)
        while db.start_point(store, self.sweep_id, pt.index):
            attempts += 1
            if not self._settle(store, pt, self._attempt(store, pt), attempts):
                return
            self._backoff(store, pt)

    def _attempt(self, store: Store, pt: Point) -> Attempt:
        try:
            run = self._start_and_watch(store, pt)
        except Stopped:
            return Attempt(Verdict.CANCELLED, "cancelled while waiting")
        except OrchError as exc:
            latest = db.latest_run(store, self.sweep_id, pt.key)
            if latest is not None and latest.status.terminal:  # the start got as far as creating its run
                db.on_run_ended(store, self.sweep_id, pt.index, latest.id)
            return Attempt(policy.failed_start(exc), str(exc))
        return self._ended(store, pt, run)

    def _start_and_watch(self, store: Store, pt: Point) -> RunRecord:
        told: list[bool] = []

        def on_wait(busy: runflow.Waiting) -> None:
            if db.cancelled(store, self.sweep_id, pt.index):
                raise Stopped()
            if not told:
                told.append(True)
                self.echo(f"point {pt.index} ({pt.label}) waits: {str(busy).removesuffix('; --queue waits')}")

        fields = {"sweep_id": self.sweep_id, "point": pt.key}
        if pt.hosts:
            run = runflow.start_nodes(self.ws, store, self.plan.playbook, pt.spec, [self.hosts[h] for h in pt.hosts],
                                      queue=True, on_wait=on_wait, run_fields=fields)
        else:
            run = runflow.start(self.ws, store, self.plan.playbook, pt.spec, self.hosts[pt.host], queue=True,
                                on_wait=on_wait, run_fields=fields, replace=self.plan.file.replace)
        self.echo(f"point {pt.index} ({pt.label}) on {'+'.join(pt.hosts) or pt.host}: run {run.run_id} started")
        if not db.attach_run(store, self.sweep_id, pt.index, run.run_id):
            runflow.stop_quietly(self.ws, store, run.run_id, "sweep cancelled", self.hosts)
        return watch(run, on_update=lambda record: self._on_update(store, pt, record))

    def _on_update(self, store: Store, pt: Point, run: RunRecord) -> None:
        """Each new reading of a point's run: the sweep's heartbeat; in a search, the pruner's look at the
        objective's live samples, and a loser stopped through the ordinary cancel (its host freed at once)."""
        self._heartbeat(store)
        if self.search is None:
            return
        why = self.search.watch(store, pt, run)
        if why is not None:
            self.echo(f"point {pt.index} ({pt.label}) on {pt.host}: {why}; stopping run {run.id}")
            self.echo(f"point {pt.index}: {runflow.stop_quietly(self.ws, store, run.id, why, self.hosts)}")

    def _resume(self, store: Store, pt: Point, record: RunRecord) -> tuple[RunRecord, bool]:
        """A run left by a dead controller: settle it if it never launched, else watch it to its end.
        Returns the ended run and whether it was watched (False: it never launched)."""
        run = runflow.open_run(self.ws, store, record, self.hosts)
        record = runflow.settle_orphan(run)
        if record.status.live:
            lease.adopt(store, record.id)
            db.settle_point(store, self.sweep_id, pt.index, PointStatus.RUNNING, run_id=record.id)
            self.echo(f"point {pt.index} ({pt.label}) on {run.host.name}: watching run {record.id} again")
            return watch(run, on_update=lambda r: self._on_update(store, pt, r)), True
        return record, False

    def _ended(self, store: Store, pt: Point, run: RunRecord) -> Attempt:
        """A point's run ended: an event, a line, and what it came to."""
        db.on_run_ended(store, self.sweep_id, pt.index, run.id)
        attempt = Attempt.of(run)
        self.echo(f"point {pt.index} ({pt.label}) on {pt.host}: run {run.id} {run.status}"
                  + (f": {run.reason}" if run.reason and attempt.verdict is not Verdict.SUCCEEDED else ""))
        return attempt

    # recording what the policy decided ---------------------------------------------------------
    def _settle(self, store: Store, pt: Point, attempt: Attempt, attempts: int) -> bool:
        """What the policy makes of an attempt, recorded; True when the point is to be tried again."""
        decision = policy.decide(attempt.verdict, attempts, self.plan.file.retries)
        if decision.action is Action.RETRY:
            return self._retry(store, pt, attempt, attempts)
        reason = attempt.reason
        if self.search is not None:
            decision, why = self.search.judge(store, pt, attempt.verdict, attempt.run_id, decision)
            reason = why or reason
        if decision.fault is Fault.FLEET:
            reason = f"{reason} (after {attempts} attempts)"
        self._record(store, pt, decision, reason, attempt.run_id)
        return False

    def _retry(self, store: Store, pt: Point, attempt: Attempt, attempts: int) -> bool:
        """The point goes back to the queue; False when it was cancelled meanwhile."""
        file = self.plan.file
        self.echo(f"point {pt.index} ({pt.label}) on {pt.host}: {attempt.reason}; retry {attempts} of "
                  f"{file.retries} in {file.retry_backoff_s:g} s")
        stored_sweeps.add_event(store, self.sweep_id, "retry", f"point {pt.index}: {attempt.reason}",
                     {"point": pt.index, "try": attempts})
        return db.settle_point(store, self.sweep_id, pt.index, PointStatus.QUEUED)

    def _record(self, store: Store, pt: Point, decision: Decision, reason: str | None, run_id: int | None) -> None:
        """The point ends as decided (unless cancelled meanwhile); a job's failure may end the queue too."""
        if not db.settle_point(store, self.sweep_id, pt.index, decision.status, reason=reason,
                               fault=decision.fault, run_id=run_id):
            return
        if decision.fault in (Fault.FLEET, Fault.SETUP):
            self.echo(f"point {pt.index} ({pt.label}) on {pt.host} failed: {reason}")
        if decision.fault is Fault.JOB and self.plan.file.fail_fast:
            self._fail_fast(store, pt)

    def _keep(self, store: Store, pt: Point, run: RunRecord) -> None:
        """A point whose run an earlier controller left finished for good: the point says so."""
        v = policy.verdict(run)
        decision, reason = policy.decide(v, 0, self.plan.file.retries), run.reason
        if self.search is not None:
            decision, why = self.search.judge(store, pt, v, run.id, decision)
            reason = why or reason
        if db.point(store, self.sweep_id, pt.index).status is not decision.status:
            db.settle_point(store, self.sweep_id, pt.index, decision.status, reason=reason,
                            fault=decision.fault, run_id=run.id)

    def _fail_fast(self, store: Store, pt: Point) -> None:
        reason = f"fail_fast: point {pt.index} failed"
        n = db.cancel_points(store, self.sweep_id, {PointStatus.QUEUED}, reason)
        stored_sweeps.add_event(store, self.sweep_id, "fail_fast", f"point {pt.index} failed; {n} queued point(s) cancelled")
        self.echo(f"fail_fast: point {pt.index} failed; {n} queued point(s) cancelled")

    # waiting -------------------------------------------------------------------------------------
    def _backoff(self, store: Store, pt: Point) -> None:
        """Wait retry_backoff_s, or less when the point is cancelled meanwhile."""
        deadline = time.monotonic() + self.plan.file.retry_backoff_s
        while (left := deadline - time.monotonic()) > 0 and not db.cancelled(store, self.sweep_id, pt.index):
            self.sleep(min(left, 0.5))

    def _heartbeat(self, store: Store) -> None:
        now = time.time()
        if now - self._beat >= HEARTBEAT_S:
            self._beat = now
            stored_sweeps.update(store, self.sweep_id, heartbeat=now)


def _taking(points: deque[Point]) -> Iterator[Point]:
    """A grid lane's points, taken one at a time (popleft is atomic: a cluster lane's threads share them)."""
    while True:
        try:
            yield points.popleft()
        except IndexError:
            return
