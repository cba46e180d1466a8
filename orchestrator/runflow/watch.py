"""The poll loop: read only the new bytes of a job's log, understand them, record them, back off.

Backoff is exponential from poll_min to poll_max, reset whenever progress advances or the phase
changes, and never sleeps past the predicted finish (the progress bar's ETA) by more than poll_min.
The wait between polls is spent on the host, inside the next poll, which returns early when the job
dies: backing off saves round trips without leaving a crash unnoticed for the whole interval.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import tenacity

from ..errors import DatabaseUnavailable, RemoteError, TransitionError, Unreachable
from ..host import health, launch, stall
from ..host.executor import Executor
from ..host.health import SERVING_PHASES, HealthCheck, HealthWatch
from ..host.launch import RunPaths, describe_exit
from ..host.polling import PollWait
from ..logparse import LogParser, Metric, assumption, stamp_time
from ..logparse.errors import describe as _error_text
from ..logparse.text import last_line
from ..logparse.tqdm import paced
from ..logparse.wake import WAKE
from ..store import Store, history
from ..store.controller import Controller
from ..store.lifecycle import transition
from ..store.record import KILL_GRACE_S, JobRef, Run, Status

if TYPE_CHECKING:
    from ..store.runtables import RunTables

FATAL_GRACE_S = 0.5  # after a fatal line, how long a living process has to exit by itself
MAX_CHUNK = 4 << 20  # bytes read per poll; a longer backlog is read by immediate re-polls
HOST_CLOCK_SLACK_S = 5.0  # how far a host's clock may be off this machine's and its times still be believed
CLOCK_SLACK_S = 300.0  # how far a log line's own time may lie outside the run and still be believed


class _Conflict(Exception):
    """Another watcher recorded this run's log first."""


@dataclass
class WatchOptions:
    """How a run is watched: its poll bounds, what its log says when it is ready or stalled, what is done then."""

    poll_min: float
    poll_max: float
    until_ready: bool = False
    ready_pattern: str | None = None
    engine: str | None = None
    stall_factor: float = 5.0
    on_stall: str = "warn"  # warn | kill | dump
    kill_grace_s: float = KILL_GRACE_S
    health: HealthCheck | None = None  # a server's endpoint, asked while it is ready; see host/health.py
    give_up_s: float | None = None  # a host silent for this long: the run ends lost
    tables: Sequence[RunTables] = ()  # plugins' tables: their readers read the log, the rows go to them
    max_failed_fraction: float = 0.0  # a benchmark's requests that may fail before the run does (a share)
    benchmark: bool = False  # a benchmark: no request completed makes its numbers invalid


@dataclass
class Staged:
    """What one state of the job adds to the record: written in one transaction with the offset it read to
    and the parser's state there, so a watcher killed at any moment leaves either all of it or none, and
    the next one reads on from the offset recorded — no line, event or sample lost or counted twice."""

    expect: int  # the offset the record must still hold: nobody else recorded these bytes meanwhile
    events: list[tuple[str, str, Any]]
    samples: list[tuple[str, float, int | None, float | None]]
    rows: list[tuple[str, dict[str, Any]]]  # plugins' rows, as (table, row)
    fields: dict[str, Any]  # the run's columns: offset, parser state, phase, progress...
    tail: bytes  # the log's bytes before the new offset
    left_queue: float | None
    end: tuple[Status, str, dict[str, Any]] | None
    now: float
    done: bool  # the wait is over once this is recorded
    stop: bool  # ...and the job's processes linger: stop them


def say(text: str) -> None:
    """A line on stderr (a background watcher's log) that never ends the watch: on a full disk it is lost."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass


class Watcher:
    def __init__(
        self,
        store: Store,
        run_id: int,
        executor: Executor,
        opts: WatchOptions,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.time,
        on_update: Callable[[Watcher], None] | None = None,
    ):
        self.store, self.run_id, self.executor, self.opts = store, run_id, executor, opts
        self.transport = executor.transport
        self.sleep, self.clock, self.on_update = sleep, clock, on_update
        self.wait = PollWait(opts.poll_min, opts.poll_max, clock)
        self.hold = 0.0  # seconds the next poll waits on the host (the backoff interval)
        self.unreachable_since: float | None = None
        self.fatal_since: float | None = None  # a fatal line was read while the process lived on
        self._wrapper_gone = False
        self.needs_stop = False
        self.left_queue: float | None = None  # a queued job was seen running: its start
        self.recorded = False
        self._health_due = 0.0  # a server's endpoint is asked at most once per poll_min
        self.db_trouble_since: float | None = None  # the database refused a write: the poll is read again
        self.db_trouble = ""  # why, as the database said it
        self.staged: Staged | None = None
        self._outcome: str | None = None  # of the last commit: None (written), "conflict", "refused"
        self._me = str(Controller.me())  # this process, as the record names its watcher
        self.health = HealthWatch(opts.health.ask, opts.health.grace_s, store, run_id) if opts.health else None
        self._load()

    def _load(self) -> None:
        run = self.store.get_run(self.run_id)
        self.run = run
        self.paths = RunPaths(run.remote_dir or "")
        self.offset = run.log_offset
        self.inode = run.log_inode
        self.tail = bytes.fromhex(run.log_tail) if run.log_tail else b""  # the bytes before the offset
        self.left_queue = None  # known again from the next state, should the record still say queued
        state = run.parser_state
        readers = [reader for t in self.opts.tables for reader in t.readers]
        self.parser = (
            LogParser.from_dict(state, readers)
            if state
            else LogParser(engine=self.opts.engine, ready_pattern=self.opts.ready_pattern, readers=readers)
        )

    @property
    def job(self) -> JobRef:
        return self.run.job or JobRef(0, "")  # (pid 0: no process is ever proved to be it)

    @property
    def status(self) -> Status:
        return self.run.status

    def run_until_done(self) -> Run:
        if self.status.terminal:
            return self.run
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(lambda done: not done),
            wait=self.wait,
            stop=tenacity.stop_never,
            sleep=self._hold_next,  # the wait happens on the host, cut short by the job's death
            reraise=True,
        )
        retrying(self.poll_once)
        return self.store.get_run(self.run_id)

    # one poll -------------------------------------------------------------------------------
    def poll_once(self) -> bool:
        """Poll the host once and record what changed. True when the wait is over."""
        return self.guarded(self._poll)

    def guarded(self, step: Callable[[], bool]) -> bool:
        """Run one step of the watch (a poll, or recording a pushed state) with the database's trouble
        kept out of the way.

        A database that refuses the write (locked past its busy timeout, read-only for a while) does not
        end the watch: nothing of the step was recorded, so the record is read back and the same log
        bytes are read again later — the run stays watched and nothing is lost.
        """
        try:
            if self.db_trouble_since is not None:
                self._load()
            done = step()
        except DatabaseUnavailable as exc:
            self.refused(exc)
            return False
        self._recovered()
        return done

    def refused(self, exc: DatabaseUnavailable) -> None:
        """The database refused this step: nothing of it was recorded; the next step reads the record back
        (`_load`) and the same log bytes are read again."""
        self.recorded = False
        self.staged = None
        self._outcome = "refused"
        if self.db_trouble_since is None:
            self.db_trouble_since, self.db_trouble = self.clock(), str(exc)
            say(f"orch: run {self.run_id}: {exc}; its watch pauses and goes on once the database takes writes")

    def _recovered(self) -> None:
        if self.db_trouble_since is not None:
            since, self.db_trouble_since = self.db_trouble_since, None
            why = ("the controller's disk was full" if "is full" in self.db_trouble
                   else "the database refused writes")
            text = (f"{why}: the watch paused {self.clock() - since:.0f} s and went on once the database took "
                    "writes again; nothing was lost")
            self.store.add_event(self.run_id, "database", text)
            say(f"orch: run {self.run_id}: {text}")

    def _poll(self) -> bool:
        self.wait.immediate = False
        hold, self.hold = self.hold, 0.0
        try:
            state = self.executor.poll(self.paths, self.job, self.offset, MAX_CHUNK, hold_s=hold,
                                       wake=[w for w in (WAKE, self.opts.ready_pattern) if w], inode=self.inode,
                                       mark=launch.tail_mark(self.tail) if self.tail else None)
        except (Unreachable, RemoteError) as exc:
            if isinstance(exc, RemoteError) and exc.remote_exit_code is not None:
                raise  # the poll itself failed on the host: not a passing network fault
            # unreachable, or no answer in time (a link that went dark mid-call): try again later
            if self.lost_touch(exc.reason if isinstance(exc, Unreachable) else str(exc)):
                return True
            self.sleep(hold)  # nothing to wait on over there: wait here
            return False
        done = self.absorb(state)
        self.stop_if_needed()
        return done

    def absorb(self, state: launch.JobState) -> bool:
        """Record one state of the job (a poll's answer, or what its host's agent pushed): True when the
        wait is over. `recorded` says whether it went in; when not (another writer was first, the
        database refused), the caller reads the log again from `offset`."""
        self.stage(state)
        with self.store.tx():
            self.commit()
        return self.settle()

    # Recording in three steps, so that a host's watcher writes the states of all its runs that came in
    # one turn in one transaction: stage each (parse, judge: no database lock held), commit them all,
    # settle each.
    def stage(self, state: launch.JobState) -> None:
        """Understand one state of the job and stage what it adds to the record (`staged`); nothing is
        written yet but a note that the host answered again. DatabaseUnavailable: see `refused`."""
        self.recorded = False
        self.staged, self._outcome = None, None
        if self.db_trouble_since is not None:
            self._load()
        if self.unreachable_since is not None:
            self.store.add_event(self.run_id, "reconnected", f"host answered again after "
                                 f"{self.clock() - self.unreachable_since:.0f} s")
            self.unreachable_since = None
        self.staged = self._record(state)

    def commit(self) -> None:
        """Write the staged record inside the caller's transaction, in a savepoint of its own: when another
        writer was first, only this run's part is rolled back."""
        if self.staged is None:
            return
        try:
            with self.store.savepoint():
                self._save(self.staged)
        except _Conflict:
            self._outcome = "conflict"

    def settle(self) -> bool:
        """After the transaction: True when the wait is over. A record not written (another writer was
        first, the database refused) leaves the watcher as the record is: it reads the log again from there.
        DatabaseUnavailable (the record written, not read back): see `refused`."""
        staged, self.staged = self.staged, None
        outcome, self._outcome = self._outcome, None
        if outcome == "conflict":
            self._load()
            return self.status.terminal
        if staged is None or outcome == "refused":
            return False
        self.recorded = True
        self.offset, self.inode, self.tail = staged.fields["log_offset"], staged.fields["log_inode"], staged.tail
        self.left_queue = None
        self.needs_stop = staged.stop  # stop_if_needed: the caller decides where the grace is waited
        self.run = self.store.get_run(self.run_id)
        self._recovered()
        if self.on_update:
            self.on_update(self)
        return staged.done

    def lost_touch(self, reason: str) -> bool:
        """The host did not answer: say so once; True when it has been silent past the give-up bound
        (the run then ended lost)."""
        self._note_unreachable(reason)
        return self._given_up(reason)

    def stop_if_needed(self) -> None:
        """A fatal line or a stall ended the run while its processes linger: stop them, the GPUs are freed."""
        if self.needs_stop:
            self.needs_stop = False
            outcome = self.executor.kill(self.job, self.opts.kill_grace_s)
            self.store.add_event(self.run_id, "stopped", f"process group: {outcome}")

    def _hold_next(self, seconds: float) -> None:
        self.hold = seconds

    def _note_unreachable(self, reason: str) -> None:
        if self.unreachable_since is None:
            now = self.clock()
            self.store.add_event(self.run_id, "unreachable", reason)  # first: a refused write is tried again
            self.unreachable_since = now

    def _given_up(self, reason: str) -> bool:
        """A host silent past the bound: the run ends lost, saying for how long and why."""
        silent = self.clock() - (self.unreachable_since or self.clock())
        if self.opts.give_up_s is None or silent < self.opts.give_up_s:
            return False
        try:
            transition(self.store, self.run_id, Status.LOST,
                       f"the host has not answered for {silent:.0f} s (unreachable_give_up_s): {reason}",
                       phase="failed")
        except TransitionError:
            pass  # someone else ended it meanwhile
        self.run = self.store.get_run(self.run_id)
        return True

    def _record(self, state: launch.JobState) -> Staged:
        p = self.parser
        before = (p.phase, p.progress.done if p.progress else None, p.error)
        version = p.engine_version
        events: list[tuple[str, str, Any]] = []
        new_offset = state.offset + len(state.data)
        more = new_offset < state.size
        inode = state.inode
        if state.rotated:  # the rest of a rotated log: once read, the new log from its start
            more = True
            if new_offset >= state.size:
                new_offset, inode = 0, None  # the new file's inode is learnt by the next poll
                events.append(("log", "log rotated; read the old file to its end, now the new one from 0", None))
        elif state.offset < self.offset:
            events.append(("log", "log replaced; reading the new one from 0"
                           if self.inode is not None and inode != self.inode else
                           f"log truncated (size {state.size} < offset {self.offset}); reading from 0", None))
        samples = p.feed(state.data)
        ended = state.exit_code is not None or not state.alive
        if ended and not more:
            samples += p.finish(exit_code=state.exit_code)
        now = self.clock()

        after = (p.phase, p.progress.done if p.progress else None, p.error)
        # every phase the log went through, not just the last: a backlog read in one poll passes several
        events += [("phase", phase, None) for phase in p.phases_passed]
        loaded = any(phase in history.LOADING for phase in p.phases_passed)  # a load begun in these bytes
        p.phases_passed.clear()
        if p.error is not None and p.error != before[2]:
            events.append(("error", _error_text(p.error), p.error.to_dict()))
        if p.engine_version != version and (assumed := assumption(p.engine, p.engine_version)) is not None:
            events.append(("warning", assumed, None))  # a version its log told, which orch's tables do not know
        fields: dict[str, Any] = {}
        last = last_line(state.data)
        if last is not None:
            fields["last_line"] = last
        started = self._host_time(state.started_at, self.run.created_at)
        if started is not None and started != self.run.started_at:
            fields["started_at"] = self.run.started_at = started  # the job's own start, not the launch's
        advanced = after[:2] != before[:2]
        if advanced:
            self.wait.reset()
            fields["progress_at"] = now
        if p.progress is not None:  # a bar that prints no rate gets one from when it moved, as tqdm's own
            fields["progress"] = paced(p.progress.to_dict(), self.run.progress, self.run.progress_at, now)
        self._scheduler(state, events, fields)
        self._wrapper(state, events)
        self._predict(p, now, fields, loaded)

        end: tuple[Status, str, dict[str, Any]] | None = None
        if not more:
            end = self._benchmark(self._judge(state), events)
            if (end is None and self.health is not None and state.alive and p.phase in SERVING_PHASES
                    and now >= self._health_due):
                self._health_due = now + self.opts.poll_min
                health_events, end = self.health.poll(self.transport, now)
                if health_events:  # a change of health, like a change of phase, is looked at again soon
                    self.wait.reset()
                events += health_events
        stalled_for = None
        if end is None and not more:
            stalled_for = self._stall(advanced, now, events, fields)
            if stalled_for is not None and self.opts.on_stall == "kill":
                end = (Status.FAILED, f"stalled: no progress for {stalled_for:.0f} s; killed", {})
        self.wait.immediate = more
        # the bytes before the new offset: the poll checks they are still there
        tail = b"" if new_offset == 0 else ((self.tail if state.offset == self.offset else b"") + state.data)
        tail = tail[-launch.TAIL_MARK:]
        if stalled_for is not None and self.opts.on_stall == "dump" and self.executor.processes:
            text = stall.dump(self.transport, self.job.id, self.job.proof)  # only processes proven the job's
            events.append(("stall-dump", f"{len(text)} bytes of stacks", {"text": text[-65536:]}))
        fields = {
            "log_offset": new_offset, "log_inode": inode, "log_tail": tail.hex(), "parser_state": p.to_dict(),
            "phase": p.phase, "progress": p.progress.to_dict() if p.progress else None,
            "error": p.error.to_dict() if p.error else None, "watcher": self._me, "heartbeat": now,
            **fields,  # may say the job is queued
        }
        return Staged(
            expect=self.offset, events=events,
            # a benchmark's row: its step is its repeat (1, 2, ...); any other sample's, its log line
            samples=[(m.name, m.value, m.line if m.repeat is None else m.repeat, self._sample_ts(m, now))
                     for m in samples],
            rows=p.take_rows(), fields=fields, tail=tail, left_queue=self.left_queue, end=end,
            now=now, done=bool(end) or self._ready(p), stop=bool(end and end[0] is Status.FAILED and state.alive))

    def _ready(self, p: LogParser) -> bool:
        return self.opts.until_ready and health.ready(p.phase, None if self.health is None else self.health.ok)

    def _scheduler(self, state: launch.JobState, events: list[tuple[str, str, Any]], fields: dict[str, Any]) -> None:
        """What a batch scheduler adds to the log: the job waits in its queue (phase `queued`, and why),
        its node. Leaving the queue is news, like a change of phase."""
        if state.queued is not None:
            fields["phase"] = "queued"
            if self.run.phase != "queued" or state.queued != self.run.queue_reason:
                events.append(("queued", f"waiting in the queue: {state.queued}", None))
                fields["queue_reason"] = state.queued
        elif self.run.phase == "queued":
            fields["queue_reason"] = None
            self.wait.reset()
        if (self.run.status is Status.QUEUED and state.queued is None
                and (state.alive or state.started_at is not None or state.node)):
            self.left_queue = self._host_time(state.started_at, self.run.created_at) or self.clock()
        if state.node and state.node != self.run.node:
            fields["node"] = state.node
            events.append(("node", f"on {state.node}", None))

    @staticmethod
    def _host_time(at: float | None, after: float) -> float | None:
        """A time the host's clock gave (the job's own start or end), when it can be this run's: not before
        `after`, not past now, give or take HOST_CLOCK_SLACK_S. A host clock ahead or behind (or a job that
        wrote its own) would give times to come and negative durations: this machine's times stand then."""
        now = time.time()  # the wall clock the run's own times were taken with, whatever clock paces the polls
        if at is None or not after - HOST_CLOCK_SLACK_S <= at <= now + HOST_CLOCK_SLACK_S:
            return None
        return min(max(at, after), now)

    def _wrapper(self, state: launch.JobState, events: list[tuple[str, str, Any]]) -> None:
        """Say once that the wrapper died while its job's process group runs on: the run stays running
        (its GPUs are in use, and `cancel` still stops it), but its exit code will never be written."""
        if state.wrapper or not state.alive or self._wrapper_gone:
            return
        self._wrapper_gone = True
        if not any(e["kind"] == "wrapper" for e in self.store.events(self.run_id)):
            events.append(("wrapper", "the wrapper is gone but the job's process group runs on", None))

    def _predict(self, p: LogParser, now: float, fields: dict[str, Any], loaded: bool = False) -> None:
        """Never sleep past the predicted finish: the bar's ETA, else the history of this model's loads."""
        bar = fields.get("progress")  # with the rate and ETA of a bar that prints none
        if bar and bar["eta_s"] is not None and (bar["total"] is None or bar["done"] < bar["total"]):
            # the ETA was printed when the bar last moved, not now
            self.wait.finish_at = (fields.get("progress_at") or self.run.progress_at or now) + bar["eta_s"]
            return
        self.wait.finish_at = None
        if (p.phase not in history.LOADING and not loaded) or not self.run.started_at:
            return
        if self.run.predicted_at is None:
            predicted = history.predicted_load_s(self.store, self.run)
            if predicted is None:
                return
            fields["predicted_at"] = self.run.started_at + predicted
            self.run.predicted_at = fields["predicted_at"]
        if p.phase in history.LOADING:  # a load already over is no reason to look again soon
            self.wait.finish_at = self.run.predicted_at

    def _stall(self, advanced: bool, now: float, events: list[tuple[str, str, Any]],
               fields: dict[str, Any]) -> float | None:
        """Flag (once) a bar that stopped advancing while the process lives; unflag when it moves."""
        was = self.run.stalled
        if advanced:
            if was:
                fields["stalled"] = 0
                events.append(("progress", "progress resumed", None))
            return None
        progress = self.parser.progress.to_dict() if self.parser.progress else None
        quiet = stall.is_stalled(progress, self.run.progress_at, self.run.started_at, now,
                                 self.opts.stall_factor, self.opts.poll_min)
        if quiet is None or was:
            return None
        fields["stalled"] = 1
        label = self.parser.progress.label if self.parser.progress else ""
        events.append(("stalled", f"no progress for {quiet:.3g} s ({label})", None))
        return quiet

    def _judge(self, state: launch.JobState) -> tuple[Status, str, dict[str, Any]] | None:
        err = self.parser.error
        if state.cause is not None:  # the scheduler ended the job (time limit, node failure, scancel...)
            status = Status.CANCELLED if state.cause.startswith("CANCELLED") else Status.FAILED
            if state.cause.startswith("UNKNOWN"):
                status = Status.LOST
            return status, state.cause, {"exit_code": state.exit_code, "phase": "failed"}
        if state.exit_code is not None:
            # the job's own view ends with its exit (at the time the host wrote): the log may not have said so
            end_at = self._host_time(state.ended_at, self.run.started_at or self.run.created_at)
            ended = {"ended_at": end_at} if end_at is not None else {}
            if state.exit_code == 0:
                return Status.SUCCEEDED, "exit code 0", {"exit_code": 0, "phase": "finished", **ended}
            why = describe_exit(state.exit_code)
            fields = {"exit_code": state.exit_code, "phase": "failed", **ended}
            return Status.FAILED, f"{why}: {_error_text(err)}" if err else why, fields
        if not state.alive and not state.run_dir:
            return Status.LOST, f"the run dir {self.paths.root} is gone from the host, and the process too", {
                "phase": "failed"}
        if not state.alive:
            return Status.LOST, self._loss(), {"phase": "failed"}
        if err is not None and err.fatal:
            # A process that printed its own end usually exits a moment later: its exit code says more.
            # One that lingers (the other ranks of a TP job hang) is stopped after the grace.
            now = self.clock()
            self.fatal_since = self.fatal_since or now
            if now - self.fatal_since < FATAL_GRACE_S:
                self.wait.look_again_at = self.fatal_since + FATAL_GRACE_S
                return None
            return Status.FAILED, f"fatal error in log: {_error_text(err)}", {}
        return None

    def _benchmark(self, end: tuple[Status, str, dict[str, Any]] | None,
                   events: list[tuple[str, str, Any]]) -> tuple[Status, str, dict[str, Any]] | None:
        """A benchmark that exits 0 with failed requests did not succeed: failed above the spec's bound
        (max_failed_fraction), degraded up to it. Failed above the bound, or with no request completed, its
        numbers are also `invalid` (a flag beside the status): never a sweep's best, never an objective."""
        requests = self.parser.requests
        if end is None or end[0] is not Status.SUCCEEDED:
            return end
        if not requests or not requests[1]:
            if self.opts.benchmark and (not requests or not requests[0]):
                why = "no request completed" if requests else "no benchmark result: no request completed"
                return end[0], end[1], {**end[2], "invalid": why}
            return end
        completed, failed = requests
        bound = self.opts.max_failed_fraction
        what = f"{failed:g} of {completed + failed:g} benchmark requests failed"
        if failed > bound * (completed + failed):
            return Status.FAILED, f"{what} (max_failed_fraction {bound:g})", {
                **end[2], "phase": "failed", "invalid": f"{what}, above max_failed_fraction {bound:g}"}
        events.append(("degraded", f"{what}: within max_failed_fraction {bound:g}", None))
        return end

    def _loss(self) -> str:
        """Why the job is gone without an exit code: a full disk, the OOM killer, or a SIGKILL or reboot."""
        why = None
        try:  # what the host can tell comes first: a wrapper and job killed together may be seen apart
            why = self.executor.explain_loss(self.paths, self.job)
        except (Unreachable, RemoteError):
            pass  # the host stopped answering just now: say what is known
        if why is None and self._wrapper_gone:
            return "the wrapper was killed; the job's processes ran on without it and are gone now (no exit code)"
        return why or "the process is gone and wrote no exit code (killed with its wrapper, or the host rebooted)"

    def _save(self, rec: Staged) -> None:
        """Write a staged record; _Conflict when another writer recorded these bytes (or the run's end) first."""
        offset, status_now = self.store.log_position(self.run_id)
        if offset != rec.expect or status_now.terminal:
            raise _Conflict()
        for kind, message, data in rec.events:
            self.store.add_event(self.run_id, kind, message, data, ts=rec.now)
        if rec.samples:
            self.store.add_metrics(self.run_id, rec.samples, rec.now)
        if rec.rows:
            self.store.add_rows(self.run_id, rec.rows, rec.now, self.opts.tables)
        self.store.update_run(self.run_id, **rec.fields)
        try:
            if rec.left_queue is not None:  # the job's own start on its node, not when it was seen
                node = rec.fields.get("node") or "its node"
                transition(self.store, self.run_id, Status.RUNNING, f"left the queue ({node})",
                           started_at=rec.left_queue)
            if rec.end:
                status, message, end_fields = rec.end
                run = self.store.get_run(self.run_id) if status_now is Status.CANCELLING else None
                if run is not None:  # its end was decided before: the job's end only confirms it (its exit
                    # by the stop's signal says nothing of the job's phase)
                    status, message = Status(run.ending_as or Status.CANCELLED), run.reason or "cancelled"
                    end_fields = {k: v for k, v in end_fields.items() if k != "phase"}
                transition(self.store, self.run_id, status, message, **end_fields)
        except TransitionError:
            raise _Conflict() from None


    def _sample_ts(self, sample: Metric, now: float) -> float | None:
        """The time the log line itself shows, read as local time; None (the poll time) where it shows none
        or one that cannot be this run's (before it started, after now: another time zone on the host)."""
        ts = stamp_time(sample.stamp, now)
        started = self.run.started_at or now
        if ts is None or ts > now + CLOCK_SLACK_S or ts < started - CLOCK_SLACK_S:
            return None
        return ts
