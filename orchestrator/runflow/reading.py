"""What a state of the job means, as the recorder's stages ask: its end (the exit, the scheduler's word, a
fatal line, a benchmark's failed requests), why it was lost, a stall, the scheduler's queue, and when to
look again (the predicted finish). Nothing here writes the record: the recorder does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import RemoteError, Unreachable
from ..host import launch, stall
from ..host.executor import Executor
from ..host.launch import RunPaths, describe_exit
from ..host.polling import PollWait
from ..logparse import LogParser
from ..logparse.errors import describe as _error_text
from ..store import Store, history
from ..store.record import JobRef, RunRecord, Status
from .context import WatchOptions

FATAL_GRACE_S = 0.5  # after a fatal line, how long a living process has to exit by itself
HOST_CLOCK_SLACK_S = 5.0  # how far a host's clock may be off this machine's and its times still be believed


class Reading:
    """The judging half of the recorder (runflow/recorder.py), which holds the state it reads."""

    store: Store
    run_id: int
    run: RunRecord
    opts: WatchOptions
    executor: Executor
    paths: RunPaths
    parser: LogParser
    wait: PollWait
    clock: Callable[[], float]
    fatal_since: float | None
    left_queue: float | None
    _wrapper_gone: bool

    @property
    def job(self) -> JobRef:
        return self.run.job or JobRef(0, "")  # (pid 0: no process is ever proved to be it)

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
