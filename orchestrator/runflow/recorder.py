"""The recorder: one state of a job (its log's new bytes, alive or not, its exit) understood and recorded.

Every reading of a run's log goes through here: what the host's agent pushes to its host's watcher, a
one-shot look (`orch status --refresh`, the orphan probe), and the end's last read of the log. A state is
recorded in stages (`_record`), each a method that records one thing — the read position, what the log
says, the job's times, its progress, the verdict, the health of a server, a stall — then written in one
transaction with the offset it read to, so a watcher killed at any moment leaves all of it or none.

How often a quiet run is looked at is `wait`, a `PollWait`: exponential from poll_min to poll_max, reset
whenever progress advances or the phase changes, never past the predicted finish by more than poll_min.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import DatabaseUnavailable, RemoteError, TransitionError, Unreachable
from ..host import health, launch, stall
from ..host.executor import Executor
from ..host.health import SERVING_PHASES, HealthWatch
from ..host.launch import RunPaths
from ..host.polling import PollWait
from ..logparse import LogParser, Metric, assumption, stamp_time
from ..logparse.errors import describe as _error_text
from ..logparse.text import last_line
from ..logparse.tqdm import paced
from ..store import Store, history
from ..store.controller import Controller
from ..store.lifecycle import transition
from ..store.record import Status
from .context import WatchOptions
from .reading import Reading

MAX_CHUNK = 4 << 20  # bytes read at once; a longer backlog is read chunk after chunk
CLOCK_SLACK_S = 300.0  # how far a log line's own time may lie outside the run and still be believed


class _Conflict(Exception):
    """Another watcher recorded this run's log first."""


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


End = tuple[Status, str, dict[str, Any]]


@dataclass
class Turn:
    """One state of the job as its stages record it, before it is staged."""

    state: launch.JobState
    now: float
    offset: int  # where the next read starts
    inode: int | None
    more: bool  # the log holds more bytes than this state brought
    tail: bytes = b""
    events: list[tuple[str, str, Any]] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    samples: list[Metric] = field(default_factory=list)
    advanced: bool = False  # the phase or the bar moved
    loaded: bool = False  # a load began in these bytes
    end: End | None = None


def say(text: str) -> None:
    """A line on stderr (a background watcher's log) that never ends the watch: on a full disk it is lost."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError:
        pass


class Recorder(Reading):
    def __init__(
        self,
        store: Store,
        run_id: int,
        executor: Executor,
        opts: WatchOptions,
        *,
        clock: Callable[[], float] = time.time,
        on_update: Callable[[Recorder], None] | None = None,
    ):
        self.store, self.run_id, self.executor, self.opts = store, run_id, executor, opts
        self.transport = executor.transport
        self.clock, self.on_update = clock, on_update
        self.wait = PollWait(opts.poll_min, opts.poll_max, clock)  # when a quiet run is looked at again
        self.unreachable_since: float | None = None
        self.fatal_since: float | None = None  # a fatal line was read while the process lived on
        self._wrapper_gone = False
        self.left_queue: float | None = None  # a queued job was seen running: its start
        self.recorded = False
        self._health_due = 0.0  # a server's endpoint is asked at most once per poll_min
        self.db_trouble_since: float | None = None  # the database refused a write: the poll is read again
        self.db_trouble = ""  # why, as the database said it
        self.staged: Staged | None = None
        self._last: Turn | None = None  # what the end's last read found so far
        self._phase_before_last: str | None = None
        self._outcome: str | None = None  # of the last commit: None (written), "conflict", "refused"
        self._me = str(Controller.me())  # this process, as the record names its watcher
        self.health = HealthWatch(opts.health.ask, opts.health.grace_s, store, run_id) if opts.health else None
        self._load()

    def _load(self) -> None:
        run = self.store.get_run(self.run_id)
        self.record = run
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
    def status(self) -> Status:
        return self.record.status

    # one look ------------------------------------------------------------------------------
    def look(self) -> bool:
        """Read the job's state once (the agent's single read) and record it. True when the wait is over."""
        return self.guarded(self._look)

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

    def _look(self) -> bool:
        try:
            state = self.executor.poll(self.paths, self.job, self.offset, MAX_CHUNK, inode=self.inode,
                                       mark=self.mark)
        except (Unreachable, RemoteError) as exc:
            if isinstance(exc, RemoteError) and exc.remote_exit_code is not None:
                raise  # the read itself failed on the host: not a passing network fault
            # unreachable, or no answer in time (a link that went dark mid-call): a later look tries again
            return self.lost_touch(exc.reason if isinstance(exc, Unreachable) else str(exc))
        return self.absorb(state)

    @property
    def mark(self) -> str | None:
        """What the bytes before the offset must still be for a read from it (see launch.tail_mark)."""
        return launch.tail_mark(self.tail) if self.tail else None

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
        self.record = self.store.get_run(self.run_id)
        self._recovered()
        if self.on_update:
            self.on_update(self)
        return staged.done

    def lost_touch(self, reason: str) -> bool:
        """The host did not answer: say so once; True when it has been silent past the give-up bound
        (the run then ended lost)."""
        self._note_unreachable(reason)
        return self._given_up(reason)

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
        self.record = self.store.get_run(self.run_id)
        return True

    def _record(self, state: launch.JobState) -> Staged:
        """Each stage records one thing of the job's state into `turn`; the verdict comes last."""
        turn = self._read_position(state)
        self._record_log(turn, finish=True)
        self._record_times(turn)
        self._record_progress(turn)
        self._scheduler(state, turn.events, turn.fields)
        self._wrapper(state, turn.events)
        self._predict(self.parser, turn.now, turn.fields, turn.loaded)
        if not turn.more:
            self._record_verdict(turn)
            self._record_health(turn)
            self._record_stall(turn)
        self.wait.immediate = turn.more
        return self._staged(turn)

    def _read_position(self, state: launch.JobState) -> Turn:
        """Where the log is read to next: past these bytes, or a rotated, replaced or truncated log's start."""
        turn = Turn(state=state, now=0.0, offset=state.offset + len(state.data), inode=state.inode,
                    more=state.offset + len(state.data) < state.size)
        if state.rotated:  # the rest of a rotated log: once read, the new log from its start
            turn.more = True
            if turn.offset >= state.size:
                turn.offset, turn.inode = 0, None  # the new file's inode is learnt by the next read
                turn.events.append(("log", "log rotated; read the old file to its end, now the new one from 0", None))
        elif state.offset < self.offset:
            turn.events.append(("log", "log replaced; reading the new one from 0"
                                if self.inode is not None and turn.inode != self.inode else
                                f"log truncated (size {state.size} < offset {self.offset}); reading from 0", None))
        tail = b"" if turn.offset == 0 else ((self.tail if state.offset == self.offset else b"") + state.data)
        turn.tail = tail[-launch.TAIL_MARK:]  # the bytes before the new offset: the next read checks they are there
        return turn

    def _record_log(self, turn: Turn, finish: bool) -> None:
        """What the parser reads in the new bytes: samples, every phase passed, a new error, an engine
        version orch's tables do not know. `finish`: a job that ended has its last line counted now."""
        p, state = self.parser, turn.state
        before = (p.phase, p.progress.done if p.progress else None, p.error)
        version = p.engine_version
        turn.samples = p.feed(state.data)
        if finish and (state.exit_code is not None or not state.alive) and not turn.more:
            turn.samples += p.finish(exit_code=state.exit_code)
        turn.now = self.clock()
        # every phase the log went through, not just the last: a backlog read at once passes several
        turn.events += [("phase", phase, None) for phase in p.phases_passed]
        turn.loaded = any(phase in history.LOADING for phase in p.phases_passed)  # a load begun in these bytes
        p.phases_passed.clear()
        if p.error is not None and p.error != before[2]:
            turn.events.append(("error", _error_text(p.error), p.error.to_dict()))
        if p.engine_version != version and (assumed := assumption(p.engine, p.engine_version)) is not None:
            turn.events.append(("warning", assumed, None))  # a version its log told, which orch's tables do not know
        turn.advanced = (p.phase, p.progress.done if p.progress else None) != before[:2]
        last = last_line(state.data)
        if last is not None:
            turn.fields["last_line"] = last

    def _record_times(self, turn: Turn) -> None:
        """The job's own start, as its host wrote it (not the launch's)."""
        started = self._host_time(turn.state.started_at, self.record.created_at)
        if started is not None and started != self.record.started_at:
            turn.fields["started_at"] = self.record.started_at = started

    def _record_progress(self, turn: Turn) -> None:
        """The bar, with a rate from when it moved for a bar that prints none (as tqdm's own)."""
        p = self.parser
        if turn.advanced:
            self.wait.reset()
            turn.fields["progress_at"] = turn.now
        if p.progress is not None:
            turn.fields["progress"] = paced(p.progress.to_dict(), self.record.progress, self.record.progress_at, turn.now)

    def _record_verdict(self, turn: Turn) -> None:
        """The run's end, when the job's state decides one."""
        turn.end = self._benchmark(self._judge(turn.state), turn.events)

    def _record_health(self, turn: Turn) -> None:
        """A serving job's endpoint, asked at most once per poll_min; its change of health is news."""
        now = turn.now
        if (turn.end is not None or self.health is None or not turn.state.alive
                or self.parser.phase not in SERVING_PHASES or now < self._health_due):
            return
        self._health_due = now + self.opts.poll_min
        health_events, turn.end = self.health.poll(self.transport, now)
        if health_events:  # a change of health, like a change of phase, is looked at again soon
            self.wait.reset()
        turn.events += health_events

    def _record_stall(self, turn: Turn) -> None:
        """A bar that stopped: flagged, and by `on_stall` killed or its stacks dumped."""
        if turn.end is not None:
            return
        stalled_for = self._stall(turn.advanced, turn.now, turn.events, turn.fields)
        if stalled_for is None:
            return
        if self.opts.on_stall == "kill":
            turn.end = (Status.FAILED, f"stalled: no progress for {stalled_for:.0f} s; killed", {})
        elif self.opts.on_stall == "dump" and self.executor.processes:
            text = stall.dump(self.transport, self.job.id, self.job.proof)  # only processes proven the job's
            turn.events.append(("stall-dump", f"{len(text)} bytes of stacks", {"text": text[-65536:]}))

    def _staged(self, turn: Turn) -> Staged:
        p = self.parser
        fields = {
            "log_offset": turn.offset, "log_inode": turn.inode, "log_tail": turn.tail.hex(),
            "parser_state": p.to_dict(), "phase": p.phase, "progress": p.progress.to_dict() if p.progress else None,
            "error": p.error.to_dict() if p.error else None, "watcher": self._me, "heartbeat": turn.now,
            **turn.fields,  # may say the job is queued
        }
        return Staged(
            expect=self.offset, events=turn.events, samples=self._samples(turn.samples, turn.now),
            rows=p.take_rows(), fields=fields, tail=turn.tail, left_queue=self.left_queue, end=turn.end,
            now=turn.now, done=bool(turn.end) or self._ready(p))

    def _samples(self, samples: list[Metric], now: float) -> list[tuple[str, float, int | None, float | None]]:
        # a benchmark's row: its step is its repeat (1, 2, ...); any other sample's, its log line
        return [(m.name, m.value, m.line if m.repeat is None else m.repeat, self._sample_ts(m, now))
                for m in samples]

    def _ready(self, p: LogParser) -> bool:
        return self.opts.until_ready and health.ready(p.phase, None if self.health is None else self.health.ok)

    def _save(self, rec: Staged) -> None:
        """Write a staged record; _Conflict when another writer recorded these bytes (or the run's end) first."""
        offset, status_now = self.store.log_position(self.run_id)
        if offset != rec.expect or status_now.terminal:
            raise _Conflict()
        self._write(rec.events, rec.samples, rec.rows, rec.fields, rec.now)
        try:
            if rec.left_queue is not None:  # the job's own start on its node, not when it was seen
                node = rec.fields.get("node") or "its node"
                transition(self.store, self.run_id, Status.RUNNING, f"left the queue ({node})",
                           started_at=rec.left_queue)
            if rec.end:
                self._save_end(rec.end, status_now)
        except TransitionError:
            raise _Conflict() from None

    def _save_end(self, end: End, status_now: Status) -> None:
        status, message, end_fields = end
        if status_now is Status.CANCELLING:  # its end was decided before: the job's end only confirms it (its
            # exit by the stop's signal says nothing of the job's phase)
            run = self.store.get_run(self.run_id)
            status, message = Status(run.ending_as or Status.CANCELLED), run.reason or "cancelled"
            end_fields = {k: v for k, v in end_fields.items() if k != "phase"}
        transition(self.store, self.run_id, status, message, **end_fields)

    def _write(self, events: list[tuple[str, str, Any]], samples: list[tuple[str, float, int | None, float | None]],
               rows: list[tuple[str, dict[str, Any]]], fields: dict[str, Any], now: float) -> None:
        for kind, message, data in events:
            self.store.add_event(self.run_id, kind, message, data, ts=now)
        if samples:
            self.store.add_metrics(self.run_id, samples, now)
        if rows:
            self.store.add_rows(self.run_id, rows, now, self.opts.tables)
        self.store.update_run(self.run_id, **fields)

    # the end's last read ----------------------------------------------------------------------------
    def read_last(self, state: launch.JobState) -> None:
        """Take one read of an ended run's log (see lastread): parsed now, recorded by `save_last`."""
        if self._last is None:
            self._phase_before_last = self.parser.phase  # the phase the end recorded stands unless this changes
        turn = self._read_position(state)
        self._record_log(turn, finish=False)  # its last line is counted once the last read is over
        last = self._last
        if last is None:
            last = self._last = Turn(state=state, now=turn.now, offset=turn.offset, inode=turn.inode, more=False)
        last.events += turn.events
        last.samples += turn.samples
        last.fields.update(turn.fields)
        last.offset, last.inode, last.tail, last.state = turn.offset, turn.inode, turn.tail, state
        self.offset, self.inode, self.tail = turn.offset, turn.inode, turn.tail

    def save_last(self, exit_code: int | None) -> None:
        """Record what the last read found, in one transaction: the run has ended, so no verdict, and the
        phase its end recorded stands unless the log went on to another."""
        last, self._last = self._last, None
        if last is None:
            return
        p, run, now = self.parser, self.record, self.clock()
        last.samples += p.finish(exit_code=exit_code)  # the job is over: a last line without its newline counts
        fields: dict[str, Any] = {
            "log_offset": last.offset, "log_inode": last.inode, "log_tail": last.tail.hex(),
            "parser_state": p.to_dict(), "error": p.error.to_dict() if p.error else None,
            # a bar that prints no rate keeps the one it had (tqdm.paced), or gets one if it moved since
            "progress": paced(p.progress.to_dict(), run.progress, run.progress_at, now) if p.progress else None,
        }
        if "last_line" in last.fields:
            fields["last_line"] = last.fields["last_line"]
        if exit_code is not None and run.exit_code is None:
            # how the process itself ended (a server whose engine core was killed exits 0): kept beside the
            # end that was decided first
            fields["exit_code"] = exit_code
        if p.phase != self._phase_before_last:  # else the phase the end recorded stands (finished, failed)
            fields["phase"] = p.phase
        events = last.events + [("phase", phase, None) for phase in p.phases_passed]
        p.phases_passed.clear()
        with self.store.tx():
            self._write(events, self._samples(last.samples, now), p.take_rows(), fields, now)

    def _sample_ts(self, sample: Metric, now: float) -> float | None:
        """The time the log line itself shows, read as local time; None (the poll time) where it shows none
        or one that cannot be this run's (before it started, after now: another time zone on the host)."""
        ts = stamp_time(sample.stamp, now)
        started = self.record.started_at or now
        if ts is None or ts > now + CLOCK_SLACK_S or ts < started - CLOCK_SLACK_S:
            return None
        return ts
