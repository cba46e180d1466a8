"""The end's own read of the log: its bytes after the watcher's last poll, parsed and recorded.

A run ended by someone else (stop, cancel, a replacing run, a sweep, another run's GPU cleanup) leaves
the bytes printed since its watcher's last poll — up to `poll_max` of them — and those printed while it
stopped. Once a run has ended no watcher records it any more, so the first end step reads the log from
the recorded offset to its last byte and records it as a poll would: metrics, phases, error, progress.

Whoever ends a run records the decision before it signals the job, and any process may be the first to
finish the run meanwhile (the host's watcher, a follower): a job still running is waited for — its stop is
under way — and only a read made once it is gone is the last one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..host import launch
from ..logparse import LogParser, Metric, stamp_time
from ..logparse.errors import describe
from ..logparse.text import last_line
from ..logparse.tqdm import paced
from ..store import runtables
from .context import Job
from .watch import CLOCK_SLACK_S, MAX_CHUNK

MAX_READS = 64  # chunks read at the end (256 MiB): a job that still prints cannot keep the end waiting
# How long the read waits for a job still running to be gone: a stop's SIGTERM grace (KILL_GRACE_S unless
# told otherwise), then its SIGKILL. A job that outlives it (its stop failed) is read as far as it got.
END_WAIT_S = 60.0


def read_to_end(ctx: Job, clock: Callable[[], float] = time.time,
                monotonic: Callable[[], float] = time.monotonic) -> None:
    """Read and record the log from the run's offset to its end, once its job is gone."""
    run = ctx.refresh()  # up to where its watcher recorded the log
    if run.job is None or not run.remote_dir:
        return  # never launched: no log
    tables = runtables.installed()
    readers = [reader for t in tables for reader in t.readers]
    parser = (LogParser.from_dict(run.parser_state, readers) if run.parser_state
              else LogParser(engine=ctx.pb.log_engine(ctx.spec), ready_pattern=ctx.pb.ready_pattern(ctx.spec),
                             readers=readers))
    offset, inode = run.log_offset, run.log_inode
    tail = bytes.fromhex(run.log_tail) if run.log_tail else b""
    error_before, phase_before = parser.error, parser.phase
    samples: list[Metric] = []
    last: str | None = None
    hold, wait_until = 0.0, monotonic() + END_WAIT_S
    exit_code = run.exit_code
    for _ in range(MAX_READS):
        state = ctx.executor.poll(ctx.paths, run.job, offset, MAX_CHUNK, hold_s=hold, inode=inode,
                                  mark=launch.tail_mark(tail) if tail else None)
        hold = 0.0
        samples += parser.feed(state.data)
        last = last_line(state.data) or last
        new = state.offset + len(state.data)
        tail = ((tail if state.offset == offset else b"") + state.data)[-launch.TAIL_MARK:]
        offset, inode = new, state.inode
        if exit_code is None and state.exit_code is not None:
            exit_code = state.exit_code  # its own end, after whoever ended the run stopped it
        if state.rotated:  # the rest of a rotated log is read; the new log is next, from its start
            if new >= state.size:
                offset, inode, tail = 0, None, b""
            continue
        if new >= state.size:
            if not state.alive or state.exit_code is not None:
                break  # gone: nothing more can come
            hold = wait_until - monotonic()
            if hold <= 0:
                ctx.event("warning", f"its job still ran {END_WAIT_S:.0f} s into the end's read of its log: "
                                     "lines it prints from now on are not recorded")
                break
            # still running (its stop under way): the host holds the next read until the job is gone
    samples += parser.finish(exit_code=exit_code)  # the job is over: a last line without its newline counts

    now = clock()
    fields: dict[str, Any] = {
        "log_offset": offset, "log_inode": inode, "log_tail": tail.hex(), "parser_state": parser.to_dict(),
        # a bar that prints no rate keeps the one it had (tqdm.paced), or gets one if it moved since
        "progress": paced(parser.progress.to_dict(), run.progress, run.progress_at, now) if parser.progress else None,
        "error": parser.error.to_dict() if parser.error else None,
    }
    if last is not None:
        fields["last_line"] = last
    if exit_code is not None and run.exit_code is None:
        # how the process itself ended (a server whose engine core was killed exits 0): kept beside the
        # end that was decided first
        fields["exit_code"] = exit_code
    if parser.phase != phase_before:  # else the phase the end recorded stands (finished, failed)
        fields["phase"] = parser.phase
    with ctx.store.tx():
        for phase in parser.phases_passed:
            ctx.store.add_event(ctx.run_id, "phase", phase, ts=now)
        if parser.error is not None and parser.error != error_before:
            ctx.store.add_event(ctx.run_id, "error", describe(parser.error), parser.error.to_dict(), ts=now)
        if samples:
            started = run.started_at or now
            ctx.store.add_metrics(ctx.run_id, [(m.name, m.value, m.line if m.repeat is None else m.repeat,
                                                _own_time(m, now, started))
                                               for m in samples], now)
        if parser.rows:
            ctx.store.add_rows(ctx.run_id, parser.take_rows(), now, tables)
        ctx.store.update_run(ctx.run_id, **fields)


def _own_time(sample: Metric, now: float, started: float) -> float | None:
    """The time the line shows, when it can be this run's (as the watcher reads it); else the read's."""
    ts = stamp_time(sample.stamp, now)
    if ts is None or ts > now + CLOCK_SLACK_S or ts < started - CLOCK_SLACK_S:
        return None
    return ts
