"""The end's own read of the log: its bytes after the watcher's last poll, parsed and recorded.

A run ended by someone else (stop, cancel, a replacing run, a sweep, another run's GPU cleanup) leaves
the bytes printed since its watcher's last poll — up to `poll_max` of them — and those printed while it
stopped. Once a run has ended no watcher records it any more, so the first end step reads the log from
the recorded offset to its last byte and records it as a poll would: metrics, phases, error, progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..host import launch
from ..logparse import LogParser, Metric, stamp_time
from ..logparse.errors import describe
from ..logparse.text import last_line
from .context import Context
from .watch import CLOCK_SLACK_S, MAX_CHUNK

MAX_READS = 64  # chunks read at the end (256 MiB): a job that still prints cannot keep the end waiting


def read_to_end(ctx: Context, clock: Callable[[], float] = time.time) -> None:
    """Read and record the log from the run's offset to its end."""
    run = ctx.run
    if run.job is None or not run.remote_dir:
        return  # never launched: no log
    parser = (LogParser.from_dict(run.parser_state) if run.parser_state
              else LogParser(engine=ctx.pb.log_engine(ctx.spec), ready_pattern=ctx.pb.ready_pattern(ctx.spec)))
    offset, inode = run.log_offset, run.log_inode
    tail = bytes.fromhex(run.log_tail) if run.log_tail else b""
    error_before, phase_before = parser.error, parser.phase
    samples: list[Metric] = []
    last: str | None = None
    for _ in range(MAX_READS):
        state = ctx.executor.poll(ctx.paths, run.job, offset, MAX_CHUNK, inode=inode,
                                  mark=launch.tail_mark(tail) if tail else None)
        samples += parser.feed(state.data)
        last = last_line(state.data) or last
        new = state.offset + len(state.data)
        tail = ((tail if state.offset == offset else b"") + state.data)[-launch.TAIL_MARK:]
        offset, inode = new, state.inode
        if state.rotated:  # the rest of a rotated log is read; the new log is next, from its start
            if new >= state.size:
                offset, inode, tail = 0, None, b""
            continue
        if new >= state.size:
            break
    samples += parser.finish(exit_code=run.exit_code)  # the job is over: a last line without its newline counts

    now = clock()
    fields: dict[str, Any] = {
        "log_offset": offset, "log_inode": inode, "log_tail": tail.hex(), "parser_state": parser.to_dict(),
        "progress": parser.progress.to_dict() if parser.progress else None,
        "error": parser.error.to_dict() if parser.error else None,
    }
    if last is not None:
        fields["last_line"] = last
    if parser.phase != phase_before:  # else the phase the end recorded stands (finished, failed)
        fields["phase"] = parser.phase
    with ctx.store.tx():
        for phase in parser.phases_passed:
            ctx.store.add_event(ctx.run_id, "phase", phase, ts=now)
        if parser.error is not None and parser.error != error_before:
            ctx.store.add_event(ctx.run_id, "error", describe(parser.error), parser.error.to_dict(), ts=now)
        if samples:
            started = run.started_at or now
            ctx.store.add_metrics(ctx.run_id, [(m.name, m.value, m.line, _own_time(m, now, started))
                                               for m in samples], now)
        if parser.debug:
            ctx.store.add_eagle3_debug(ctx.run_id, parser.take_debug(), now)
        ctx.store.update_run(ctx.run_id, **fields)


def _own_time(sample: Metric, now: float, started: float) -> float | None:
    """The time the line shows, when it can be this run's (as the watcher reads it); else the read's."""
    ts = stamp_time(sample.stamp, now)
    if ts is None or ts > now + CLOCK_SLACK_S or ts < started - CLOCK_SLACK_S:
        return None
    return ts
