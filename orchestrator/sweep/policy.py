"""The retry policy: what one attempt of a point says, and what the point does next. Pure: no I/O.

A failure that is the fleet's fault (a host unreachable at start, a job `lost`) is retried `retries`
times; a crash inside the job never is, nor a failure retrying cannot heal (a wrong host key, a refusal
before launch).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from ..errors import HostKeyError, OrchError, Unreachable
from ..store.record import RunRecord, Status
from .record import Fault, PointStatus, SweepStatus


class Verdict(StrEnum):
    """What a point's run (or its failed start) says about the point."""

    ACTIVE = "active"  # the run has not ended
    SUCCEEDED = "succeeded"
    JOB = "job"  # the job ran and failed: its own fault
    FLEET = "fleet"  # the host was unreachable, or the job was lost
    CANCELLED = "cancelled"
    SETUP = "setup"  # it failed before launch, for a reason another attempt would meet again


def verdict(run: RunRecord) -> Verdict:
    status = run.status
    if not status.terminal:
        return Verdict.ACTIVE
    if status is Status.SUCCEEDED:
        return Verdict.SUCCEEDED
    if status is Status.FAILED and run.launched:
        return Verdict.JOB
    if status is Status.LOST:
        return Verdict.FLEET
    return Verdict.CANCELLED if status is Status.CANCELLED else Verdict.SETUP


def failed_start(exc: OrchError) -> Verdict:
    """A start that raised: an unreachable host may come back; a wrong key or user, or any refusal, will not."""
    return Verdict.FLEET if isinstance(exc, Unreachable) and not isinstance(exc, HostKeyError) else Verdict.SETUP


class Action(StrEnum):
    DONE = "done"  # the point ended: succeeded, or cancelled
    RETRY = "retry"  # queue it again, after the backoff
    FAIL = "fail"


@dataclass(frozen=True)
class Decision:
    action: Action
    status: PointStatus  # the point's status after the decision
    fault: Fault | None = None


def decide(v: Verdict, attempts: int, retries: int) -> Decision:
    """The point's next step after an attempt; `attempts`: the attempts made so far, this one included."""
    if v is Verdict.SUCCEEDED:
        return Decision(Action.DONE, PointStatus.SUCCEEDED)
    if v is Verdict.CANCELLED:
        return Decision(Action.DONE, PointStatus.CANCELLED)
    if v is Verdict.JOB:
        return Decision(Action.FAIL, PointStatus.FAILED, Fault.JOB)
    if v is Verdict.SETUP:
        return Decision(Action.FAIL, PointStatus.FAILED, Fault.SETUP)
    # the fleet's fault (or a watch that returned before its run ended): worth another attempt
    if attempts > retries:
        return Decision(Action.FAIL, PointStatus.FAILED, Fault.FLEET)
    return Decision(Action.RETRY, PointStatus.QUEUED)


class Resume(StrEnum):
    """What a point does with the latest run an earlier controller left."""

    KEEP = "keep"  # it finished for good: record it, never run it again
    WATCH = "watch"  # it may still run: settle or watch it to its end
    RUN = "run"  # run the point again


def resume(v: Verdict) -> Resume:
    if v in (Verdict.SUCCEEDED, Verdict.JOB):
        return Resume.KEEP
    return Resume.WATCH if v is Verdict.ACTIVE else Resume.RUN


def outcome(points: Iterable[PointStatus]) -> SweepStatus:
    """How a sweep that ran to its end came out: succeeded only when every point did."""
    return SweepStatus.SUCCEEDED if all(s is PointStatus.SUCCEEDED for s in points) else SweepStatus.FAILED


def runs_again(status: PointStatus, fault: Fault | None) -> bool:
    """What a new controller queues again: whatever did not finish last time (a job's own failure did)."""
    if status in (PointStatus.RUNNING, PointStatus.CANCELLED):
        return True
    return status is PointStatus.FAILED and fault is not Fault.JOB
