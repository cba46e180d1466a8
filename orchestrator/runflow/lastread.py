"""The end's own read of the log: its bytes after the watcher's last record, read and recorded by the recorder.

A run ended by someone else (stop, cancel, a replacing run, a sweep, another run's GPU cleanup) leaves
the bytes printed since its watcher last recorded it and those printed while it stopped. Once a run has
ended no watcher records it any more, so the first end step reads the log from the recorded offset to
its last byte and records it through the watcher's own recorder: metrics, phases, error, progress.

Whoever ends a run records the decision before it signals the job, and any process may be the first to
finish the run meanwhile (the host's watcher, a follower): a job still running is waited for on its host
— its stop is under way — and only a read made once it is gone is the last one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..store import runtables
from .context import Run
from .recorder import MAX_CHUNK, Recorder, WatchOptions

MAX_READS = 64  # chunks read at the end (256 MiB): a job that still prints cannot keep the end waiting
# How long the read waits for a job still running to be gone: a stop's SIGTERM grace (KILL_GRACE_S unless
# told otherwise), then its SIGKILL. A job that outlives it (its stop failed) is read as far as it got.
END_WAIT_S = 60.0


def read_to_end(run: Run, clock: Callable[[], float] = time.time,
                monotonic: Callable[[], float] = time.monotonic) -> None:
    """Read and record the log from the run's offset to its end, once its job is gone."""
    record = run.refresh()  # up to where its watcher recorded the log
    if record.job is None or not record.remote_dir:
        return  # never launched: no log
    # what reading a log takes; the run has ended, so nothing that paces looks or judges an end
    opts = WatchOptions(poll_min=0.0, poll_max=0.0, engine=run.pb.log_engine(run.spec),
                        ready_pattern=run.pb.ready_pattern(run.spec), tables=runtables.installed())
    rec = Recorder(run.store, run.run_id, run.executor, opts, clock=clock)
    hold, wait_until = 0.0, monotonic() + END_WAIT_S
    exit_code = record.exit_code
    for _ in range(MAX_READS):
        # the host holds the read (hold_s) until the job is gone: its end wakes it, not a timer here
        state = run.executor.poll(run.paths, record.job, rec.offset, MAX_CHUNK, hold_s=hold, inode=rec.inode,
                                  mark=rec.mark)
        hold = 0.0
        rec.read_last(state)
        if exit_code is None and state.exit_code is not None:
            exit_code = state.exit_code  # its own end, after whoever ended the run stopped it
        if state.rotated or rec.offset < state.size:
            continue  # the rest of a rotated log, then the new log from its start; or the next chunk
        if not state.alive or state.exit_code is not None:
            break  # gone: nothing more can come
        hold = wait_until - monotonic()
        if hold <= 0:
            run.event("warning", f"its job still ran {END_WAIT_S:.0f} s into the end's read of its log: "
                                 "lines it prints from now on are not recorded")
            break
    rec.save_last(exit_code)
