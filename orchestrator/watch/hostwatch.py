"""One watcher per (workspace, host): one connection, one agent, every active run of the host followed.

The host's agent (the host side, host/hostjobs/) pushes each run's new log bytes, its end and its liveness as they
happen; the host watcher hands each push to that run's recorder (runflow/recorder.py), whose parser decides what it
means, and which records it. Quiet runs are looked at again on the backoff (`poll_min` → `poll_max`), for the
stall detector and a server's health endpoint. The agent's beat (every 2 s) says the host answers: it
refreshes the heartbeat of the runs followed (the `seen` column), at most every BEAT_WRITE_S. The end of
a run (stopping processes that linger after a fatal line, the end steps) happens on a thread of its own,
so one run's end steps never delay the news of another.

Found by an flock per host (`runs/watchers/<host>.lock`); started by `orch run`, `orch watch`, `orch
status`, a sweep or the dashboard when a host with active runs has none (`watching.ensure_watched`);
gone LINGER_S after its host's last active run ended. While it follows a run it holds that run's watch
lock too, so nobody else reads it. The ended run's end steps wait for its followers to let go of
it (a terminal that follows the run runs them itself): the kernel wakes the wait, no timer.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config.hosts import Host, Inventory
from ..config.workspace import Workspace
from ..errors import DatabaseUnavailable, OrchError, Unreachable
from ..host.agent import AgentLink, Push
from ..host.launch import HostExecutor, pushed_state
from ..host.polling import default_poll, next_look_s
from ..host.remote import connect
from ..host.ssh import SSHTransport
from ..runflow import Run, finish, notify, open_run, settle_orphan, watch_options
from ..runflow.ending import complete_cancel
from ..runflow.look import finish_if_over
from ..runflow.recorder import Recorder, say
from ..runflow.watching import FileLock, WatchLock, await_followers, host_lock_path, watched_elsewhere
from ..store import Store
from ..store.controller import STALE_FACTOR, Controller
from ..store.record import ACTIVE, RunRecord, Status

SYNC_S = 1.0  # how often the database is asked whether anyone else wrote to it (runs started, ended, cancelled)
FULL_SYNC_S = 10.0  # and how often the host's runs are read in any case: a starter or a remote watcher may die
LINGER_S = 5.0  # with no active run left, how long to wait for a new one before exiting
TURN_MAX = 256  # pushes taken in one turn of the loop, at most (one transaction records them)
RESYNC_S = 1.0  # after a state that could not be recorded, the agent re-reads the log this much later
RECONNECT_MAX_S = 30.0
BEAT_WRITE_S = 10.0  # the agent beats every 2 s: its runs' heartbeat is written at most this often, not at each
CANCEL_RETRY_S = 30.0  # a cancelling run whose stop failed here is tried again this much later (or on reconnect)


@dataclass
class WatchedRun:
    run: Run
    watcher: Recorder
    lock: WatchLock
    due: float  # monotonic time of the next look at a quiet run
    resync_at: float | None = None
    adopted: bool = False  # its lease names this watcher

    @property
    def scheduled(self) -> bool:
        """A batch job: the agent follows its log, the scheduler says whether it lives."""
        return not self.run.executor.processes


class HostWatcher:
    def __init__(self, ws: Workspace, host_name: str, hosts: Inventory | None = None,
                 echo: Callable[[str], None] | None = None, busy_timeout_s: float | None = None):
        self.ws = ws
        self.hosts = hosts or Inventory.load(ws.hosts_file, ws.root)
        self.host: Host = self.hosts.get(host_name)
        # (a watcher in the process that follows the run waits on a locked database as that process does)
        self.store = Store(ws.db_path) if busy_timeout_s is None else Store(ws.db_path, busy_timeout_s)
        self.echo = echo or say
        self.runs: dict[int, WatchedRun] = {}
        self.link: AgentLink | None = None
        self.executor = HostExecutor(connect(self.host), None)  # through the agent once it runs
        self.starters = 0  # runs whose starter is still at work on them (preparing, or handing a launched one over)
        self._retry_at = 0.0
        self._retry_s = 1.0
        self._enders: list[threading.Thread] = []
        self._beat_due = 0.0  # when the next beat of the agent is written to the runs' heartbeat
        self._taken_over: set[int] = set()  # ended runs whose end steps a thread here takes over
        self._cancelling: set[int] = set()  # cancelling runs whose job a thread here stops
        self._cancel_tried: dict[int, float] = {}  # when a stop of each was last tried here (a failed one waits)
        self._paused_since: float | None = None  # the database could not be written: the loop waits
        self._next_sync = self._full_sync = 0.0  # (monotonic) the next look at the record, and the next full one
        self._idle_since: float | None = None  # since when no run was left to watch
        self._later: list[Push] = []  # pushes left for the next turn: their run's previous one is recorded first
        self.stopping = threading.Event()  # set from another thread: the loop ends at its next turn
        self.clock: Callable[[], float] = time.monotonic  # (both replaceable: a test drives the loop's time)
        self.sleep: Callable[[float], None] = time.sleep

    # the loop -----------------------------------------------------------------------------------------
    def serve(self) -> bool:
        """Watch the host's runs until none is left; False when another process is its watcher."""
        lock = FileLock(host_lock_path(self.ws, self.host.name))
        if not lock.acquire():
            return False
        try:
            self._loop()
        finally:
            for thread in self._enders:
                thread.join()
            notify.drain()  # a notification still in flight is delivered (or reported) before the exit
            for f in self.runs.values():
                f.lock.release()
            if self.link is not None:
                self.link.close()
            self.store.close()
            lock.release()
        return True

    def _loop(self) -> None:
        self._next_sync = self._full_sync = 0.0
        self._idle_since = None
        while not self.stopping.is_set():
            try:
                if self._turn():
                    return
            except DatabaseUnavailable as exc:  # a full disk, a database locked or read-only: paused, never dead
                self._pause(exc)
                continue
            self._resume()

    def _turn(self) -> bool:
        """One turn of the loop: True when the watcher is done (no run left to watch)."""
        now = self.clock()
        if now >= self._next_sync:
            # the record is read again only when another process wrote to it (a run started, ended or
            # cancelled), while a starter is at work, and now and then (who watches a run may change
            # by the clock alone): an idle watcher costs a look at one number
            if self.store.changed() or self.starters or now >= self._full_sync:
                self._sync()
                self._full_sync = now + FULL_SYNC_S
            self._next_sync = now + SYNC_S
        next_sync = self._next_sync
        if self.runs or self.starters:
            self._idle_since = None
        else:
            self._idle_since = self._idle_since or now
            if now - self._idle_since > LINGER_S:
                return True
        if ((self.runs or self.starters) and (self.link is None or not self.link.alive)
                and now >= self._retry_at):  # connected while a run prepares: ready for its first byte
            self._connect()
        self._look_again(now)
        if self.link is None or not self.link.alive:  # nothing comes from the host: until the next retry or sync
            retry = self._retry_at if self._retry_at > now else next_sync
            self.sleep(max(0.0, min(next_sync, retry) - self.clock()))
            return False
        wait = max(0.0, min([next_sync, *(f.due for f in self.runs.values())]) - self.clock())
        pushes: list[Push] = []
        if not self._later:  # (pushes left from the last turn are taken at once)
            try:
                pushes.append(self.link.pushes.get(timeout=wait))
            except queue.Empty:
                return False
        while len(pushes) < TURN_MAX:  # whatever else came meanwhile: recorded together
            try:
                pushes.append(self.link.pushes.get_nowait())
            except queue.Empty:
                break
        self._take_turn(pushes)
        return False

    def _pause(self, exc: DatabaseUnavailable) -> None:
        """The database cannot be written (the controller's disk is full, say): nothing of this turn was
        recorded; the runs are read again from their record once it can be, and meanwhile nothing is lost —
        the host keeps the log. Said once on stderr (a full disk may swallow that too)."""
        if self._paused_since is None:
            self._paused_since = self.clock()
            self.echo(f"orch: the watcher of {self.host.name} pauses: {exc}; it goes on once the database "
                      "takes writes again")
        for f in self.runs.values():
            f.watcher.refused(exc)  # each run says how long it paused once it is recorded again
            f.resync_at = self.clock() + RESYNC_S
        self._next_sync = self.clock() + RESYNC_S
        self.sleep(RESYNC_S)

    def _resume(self) -> None:
        if self._paused_since is not None:
            self._paused_since = None
            self.echo(f"orch: the watcher of {self.host.name} goes on")

    def _connect(self) -> None:
        transport = connect(self.host)
        try:
            self.link = AgentLink.start(transport)
        except OrchError as exc:
            self.link = None
            reason = exc.reason if isinstance(exc, Unreachable) else str(exc)
            for f in list(self.runs.values()):
                if f.watcher.lost_touch(reason):
                    self._end(f)
            self._retry_at = self.clock() + self._retry_s
            self._retry_s = min(RECONNECT_MAX_S, self._retry_s * 2)
            return
        self._retry_s = 1.0
        if isinstance(transport, SSHTransport):
            transport.hold_open()
        self.executor.link = self.link
        for f in self.runs.values():
            self._follow(f)
        self._complete_cancels(self.store.statuses(self.host.name, [Status.CANCELLING.value]), reconnected=True)

    def _follow(self, f: WatchedRun) -> None:
        w = f.watcher
        if self.link is None or not self.link.alive:
            return
        f.resync_at = None
        try:
            self.link.tell("follow", key=str(w.run_id), dir=w.paths.root, pid=w.job.id, start=w.job.proof,
                           offset=w.offset, inode=w.inode, tail=w.tail.hex(), scheduled=f.scheduled)
        except Unreachable:
            pass  # the link's end is a push of its own: handled there

    def _look_again(self, now: float) -> None:
        """Ask the agent for the state of quiet runs whose next look is due, and re-read those whose
        last state could not be recorded."""
        if self.link is None or not self.link.alive:
            return
        due = []
        for f in self.runs.values():
            if f.resync_at is not None:
                if now >= f.resync_at:
                    self._follow(f)
            elif now >= f.due:
                due.append(str(f.watcher.run_id))
                f.due = now + self._interval(f)
        if due:
            try:
                self.link.tell("poke", keys=due)
            except Unreachable:
                pass

    @staticmethod
    def _interval(f: WatchedRun) -> float:
        return next_look_s(f.watcher.wait, f.run.host, f.scheduled and f.watcher.record.status is Status.QUEUED)

    # pushes -------------------------------------------------------------------------------------------
    def _take_turn(self, pushes: list[Push]) -> None:
        """Record the pushes of one turn in one transaction: each run's state is staged (parsed and judged,
        no lock held), then all are written together, each with the offset its bytes end at. A run's
        second push in the turn waits for the next one, as it reads on from what the first records."""
        pushes, self._later = [*self._later, *pushes], []
        link = self.link
        staged: list[WatchedRun] = []
        beat = False
        for push in pushes:
            if push.kind == "beat":
                beat = True
                continue
            if push.kind == "closed":
                self._commit(staged)  # what came before the link closed
                staged = []
                self._lost_link("the agent's channel closed (the link went dark, or the agent was killed)")
                continue
            f = self._followed(push)
            if f is None:
                continue
            if any(g is f for g in staged):
                self._later.append(push)
            elif self._stage(f, push):
                staged.append(f)
        self._commit(staged)
        if beat:
            self._beat()
        if link is not None:  # what this turn is done with makes room for the agent's next pushes
            link.ack(sum(p.size for p in pushes) - sum(p.size for p in self._later))

    def _followed(self, push: Push) -> WatchedRun | None:
        if push.kind != "state" or push.key is None or not push.key.isdigit():
            return None
        return self.runs.get(int(push.key))

    def _stage(self, f: WatchedRun, push: Push) -> bool:
        """Stage what a push says of its run; False when there is nothing to record."""
        w = f.watcher
        state = pushed_state(push.doc)
        if state.offset != w.offset and not (state.offset == 0 and not state.rotated):
            f.resync_at = f.resync_at or self.clock()  # the agent read on past the record: again from it
            return False
        if f.scheduled:
            try:
                state = f.run.executor.judge(w.job, state)
            except Unreachable as exc:  # the scheduler did not answer: these bytes again, later
                f.resync_at = self.clock() + RESYNC_S
                if w.lost_touch(exc.reason):
                    self._end(f)
                return False
        try:
            w.stage(state)
        except DatabaseUnavailable as exc:  # these bytes again, once the database takes writes
            w.refused(exc)
            f.resync_at = self.clock() + RESYNC_S
            return False
        return True

    def _commit(self, staged: list[WatchedRun]) -> None:
        """Write the staged states in one transaction, then act on each: a run not recorded (another
        writer was first, the database refused) reads its log again from the record; an ended one ends."""
        if not staged:
            return
        try:
            with self.store.tx():
                for f in staged:
                    f.watcher.commit()
        except DatabaseUnavailable as exc:
            for f in staged:
                f.watcher.refused(exc)
        for f in staged:
            w = f.watcher
            try:
                done = w.settle()
            except DatabaseUnavailable as exc:  # recorded, not read back: the next push reads the record first
                w.refused(exc)
                done = False
            if not w.recorded and not done:
                f.resync_at = self.clock() + RESYNC_S
            f.due = self.clock() + self._interval(f)
            if done:
                self._end(f)

    def _beat(self) -> None:
        """The agent beat: its host answers. The runs followed are seen now, whatever their backoff; one
        write for all of them, at most every BEAT_WRITE_S."""
        now = self.clock()
        if now < self._beat_due or not self.runs:
            return
        self._beat_due = now + BEAT_WRITE_S  # (also when refused: a locked database is not waited on at each beat)
        try:  # only runs whose record names this process their watcher: nobody else's liveness is vouched for
            self.store.beat(self.runs, str(Controller.me()), time.time())
        except DatabaseUnavailable:
            pass  # the next beat after BEAT_WRITE_S tries again

    def _lost_link(self, reason: str) -> None:
        if self.link is not None:
            self.link.close()
            self.link.transport.close()  # the next connect starts afresh, not on a dead connection
        self.link = None
        for f in list(self.runs.values()):
            if f.watcher.lost_touch(reason):
                self._end(f)

    # the record ---------------------------------------------------------------------------------------
    def _sync(self) -> None:
        """Follow the host's runs that became active, settle those whose starter died, drop ended ones."""
        active = self.store.statuses(self.host.name, [s.value for s in ACTIVE])
        for run_id in [i for i in self.runs if i not in active]:
            self._end(self.runs[run_id])  # ended elsewhere (cancel, stop): its end steps once, here or there
        self.starters = 0
        for run_id in active:
            if run_id in self.runs:
                self._adopt_lease(self.runs[run_id])
                continue
            try:
                run = self.store.get_run(run_id)
                if run.status.live and run.launched:
                    self._adopt(run)
                elif run.status in (Status.PENDING, Status.PREPARING, Status.LAUNCHING):
                    self._starting(run)
            except DatabaseUnavailable:
                raise  # the whole watcher pauses (see _pause); this run is read again then
            except OrchError as exc:
                self.echo(f"orch: run {run_id} on {self.host.name}: {exc}")
        self._complete_cancels(active)
        for run in self.store.abandoned_ends(self.host.name):
            if run.id not in self._taken_over:
                self._taken_over.add(run.id)
                self._on_thread(run.id, functools.partial(self._take_over, run.id))

    def _complete_cancels(self, active: dict[int, str], reconnected: bool = False) -> None:
        """Stop the jobs of the runs cancelled while the host did not answer, now that it does (each on a
        thread of its own: a stop waits its grace). One whose canceller is still at its stop is left to it:
        taken only once the canceller said it could not stop it, or once this watcher reconnected."""
        if self.link is None or not self.link.alive:
            return
        for run_id, status in active.items():
            if status != Status.CANCELLING.value or run_id not in self.runs or run_id in self._cancelling:
                continue
            tried = self._cancel_tried.get(run_id)
            if reconnected or (self.store.last_event(run_id, ("cancelling",)) is not None and (
                    tried is None or self.clock() - tried >= CANCEL_RETRY_S)):
                self._cancel_tried[run_id] = self.clock()
                self._cancelling.add(run_id)
                self._on_thread(run_id, functools.partial(self._complete_cancel, run_id))

    def _complete_cancel(self, run_id: int) -> None:
        store = Store(self.ws.db_path)
        try:
            run = open_run(self.ws, store, run_id, self.hosts, any_spec=True)
            if run.executor.processes:
                run.executor = self.executor  # through this watcher's own link, which just answered
            complete_cancel(run, look_first=False)
        except OrchError as exc:
            self.echo(f"orch: run {run_id}: its stop: {exc}")
        finally:
            store.close()
            self._cancelling.discard(run_id)

    def _take_over(self, run_id: int) -> None:
        """An ended run whose end step's claimer died before it was done: its end steps run here (its
        lease freed only once the host shows its job is not running)."""
        store = Store(self.ws.db_path)
        try:
            finish_if_over(open_run(self.ws, store, run_id, self.hosts, any_spec=True))
        except OrchError as exc:
            self.echo(f"orch: run {run_id}: end steps: {exc}")
        finally:
            store.close()
            self._taken_over.discard(run_id)

    def _on_thread(self, run_id: int, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=f"orch-end-{run_id}")
        self._enders = [t for t in self._enders if t.is_alive()] + [thread]
        thread.start()

    def _adopt(self, record: RunRecord) -> None:
        poll_max = default_poll(self.host)[1]
        if watched_elsewhere(record, poll_max):
            return
        lock = WatchLock(self.ws, record.id)
        if not lock.acquire():
            # its starter has launched it and not yet let go (or a process here watches it): looked for
            # again at the next sync, not only when the record next changes — nothing writes it at the
            # hand-over, and a watcher that counted no run would linger out meanwhile
            self.starters += 1
            return
        try:
            run = open_run(self.ws, self.store, record, self.hosts, any_spec=True)
            # this host's processes are signalled through its agent; a batch job through its scheduler
            executor = self.executor if run.executor.processes else run.executor
            watcher = Recorder(self.store, record.id, executor, watch_options(run.pb, run.spec, run.host))
        except BaseException:
            lock.release()
            raise
        f = WatchedRun(run, watcher, lock, due=self.clock())
        self.runs[record.id] = f  # followed from here: a write refused below pauses it like any other
        self._follow(f)
        self._adopt_lease(f)

    def _adopt_lease(self, f: WatchedRun) -> None:
        """The run's lease names this live watcher (once: tried again at each sync until written)."""
        from ..store import lease

        if not f.adopted:
            lease.adopt(self.store, f.watcher.run_id)
            f.adopted = True

    def _starting(self, run: RunRecord) -> None:
        """A run its starter is preparing or launching: left alone while the starter lives, settled once
        it died (ended when it never launched, picked up when its job started)."""
        starter = run.watched_by
        poll_max = max(float(run.spec.get("poll_max") or 0), default_poll(self.host)[1])
        if starter is not None and starter.alive(run.heartbeat, STALE_FACTOR * poll_max):
            self.starters += 1
            return
        with WatchLock(self.ws, run.id) as lock:
            if lock.held:
                settle_orphan(open_run(self.ws, self.store, run, self.hosts, any_spec=True))

    def _end(self, f: WatchedRun) -> None:
        """The run ended (or was ended elsewhere): stop following it; on a thread of its own, stop what
        of its job lingers and run its end steps."""
        run_id = f.watcher.run_id
        self.runs.pop(run_id, None)
        if self.link is not None and self.link.alive:
            try:
                self.link.tell("unfollow", key=str(run_id))
            except Unreachable:
                pass
        self._on_thread(run_id, lambda: self._finish(f))

    def _finish(self, f: WatchedRun) -> None:
        store = Store(self.ws.db_path)
        try:
            w = f.watcher
            await_followers(self.ws, w.run_id)  # a follower runs the end steps itself and shows their outcome
            run = open_run(self.ws, store, w.run_id, self.hosts, any_spec=True)
            finish(run)  # none left to do when the follower did them
        except OrchError as exc:
            self.echo(f"orch: run {f.watcher.run_id}: end steps: {exc}")
        finally:
            store.close()
            f.lock.release()


def serve(ws: Workspace, host_name: str) -> bool:
    """`orch watch-host NAME`: the host's watcher, until its last active run ended."""
    return HostWatcher(ws, host_name).serve()


def main(argv: list[str]) -> int:
    """`python -m orchestrator.watch.hostwatch HOST [--hosts FILE]`: the host's watcher as orch starts it, without
    the CLI. A fleet has one of these per host, each a process of its own: Typer and Rich would be loaded
    in every one for nothing."""
    host, hosts_file = None, None
    args = iter(argv)
    for arg in args:
        if arg == "--hosts":
            hosts_file = next(args, None)
        elif host is None and not arg.startswith("-"):
            host = arg
    if host is None:
        print("usage: python -m orchestrator.watch.hostwatch HOST [--hosts FILE]", file=sys.stderr)
        return 2
    from ..host import remote

    try:
        ws = Workspace.find(hosts_file)
        Inventory.load(ws.hosts_file, ws.root).get(host)  # an unknown host: one line, as `orch watch-host` says it
        serve(ws, host)
    except OrchError as exc:
        print(f"orch: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        remote.close_all()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
