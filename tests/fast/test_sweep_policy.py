"""The sweep retry policy as tables: every verdict, attempts and retries; what a run says; what resumes."""

from __future__ import annotations

import pytest

from orchestrator.errors import HostKeyError, OrchError, RemoteError, Unreachable, UsageError
from orchestrator.store.record import RunRecord, Status
from orchestrator.sweep import policy
from orchestrator.sweep.policy import Action, Decision, Resume, Verdict, decide
from orchestrator.sweep.record import Fault, PointStatus, SweepStatus

DONE_OK = Decision(Action.DONE, PointStatus.SUCCEEDED)
DONE_CANCELLED = Decision(Action.DONE, PointStatus.CANCELLED)
FAIL_JOB = Decision(Action.FAIL, PointStatus.FAILED, Fault.JOB)
FAIL_SETUP = Decision(Action.FAIL, PointStatus.FAILED, Fault.SETUP)
FAIL_FLEET = Decision(Action.FAIL, PointStatus.FAILED, Fault.FLEET)
RETRY = Decision(Action.RETRY, PointStatus.QUEUED)


def expected(v: Verdict, attempts: int, retries: int) -> Decision:
    """The rule in words: only the fleet's fault is retried, `retries` extra attempts at most."""
    fixed = {Verdict.SUCCEEDED: DONE_OK, Verdict.CANCELLED: DONE_CANCELLED, Verdict.JOB: FAIL_JOB,
             Verdict.SETUP: FAIL_SETUP}
    if v in fixed:
        return fixed[v]
    return RETRY if attempts <= retries else FAIL_FLEET  # fleet, and a watch that returned early


@pytest.mark.parametrize("retries", [0, 1, 2, 5])
@pytest.mark.parametrize("attempts", [0, 1, 2, 3, 6, 7])
@pytest.mark.parametrize("v", list(Verdict))
def test_decide_every_verdict_attempts_and_retries(v: Verdict, attempts: int, retries: int) -> None:
    assert decide(v, attempts, retries) == expected(v, attempts, retries)


@pytest.mark.parametrize("retries, tries", [(0, 1), (1, 2), (3, 4)])
def test_a_fleet_failure_gets_retries_extra_attempts(retries: int, tries: int) -> None:
    attempts = 1
    while decide(Verdict.FLEET, attempts, retries).action is Action.RETRY:
        attempts += 1
    assert attempts == tries and decide(Verdict.FLEET, attempts, retries) == FAIL_FLEET


@pytest.mark.parametrize("status, launched, v", [
    (Status.PENDING, False, Verdict.ACTIVE),
    (Status.PREPARING, False, Verdict.ACTIVE),
    (Status.LAUNCHING, False, Verdict.ACTIVE),
    (Status.RUNNING, True, Verdict.ACTIVE),
    (Status.SUCCEEDED, True, Verdict.SUCCEEDED),
    (Status.FAILED, True, Verdict.JOB),  # the job ran and failed
    (Status.FAILED, False, Verdict.SETUP),  # refused before launch
    (Status.LOST, True, Verdict.FLEET),
    (Status.LOST, False, Verdict.FLEET),
    (Status.CANCELLED, True, Verdict.CANCELLED),
    (Status.CANCELLED, False, Verdict.CANCELLED),
])
def test_verdict_of_a_run(status: Status, launched: bool, v: Verdict) -> None:
    run = RunRecord(1, "command", "h", status, pid=123 if launched else None)
    assert policy.verdict(run) is v


@pytest.mark.parametrize("exc, v", [
    (Unreachable("h", "connection refused"), Verdict.FLEET),
    (HostKeyError("h", "unknown host key"), Verdict.SETUP),  # a wrong key does not heal on retry
    (RemoteError("h", "nvidia-smi", 9, "boom"), Verdict.SETUP),
    (UsageError("bad"), Verdict.SETUP),
    (OrchError("busy"), Verdict.SETUP),
])
def test_failed_start(exc: OrchError, v: Verdict) -> None:
    assert policy.failed_start(exc) is v


@pytest.mark.parametrize("v, step", [
    (Verdict.SUCCEEDED, Resume.KEEP), (Verdict.JOB, Resume.KEEP), (Verdict.ACTIVE, Resume.WATCH),
    (Verdict.FLEET, Resume.RUN), (Verdict.SETUP, Resume.RUN), (Verdict.CANCELLED, Resume.RUN),
])
def test_resume(v: Verdict, step: Resume) -> None:
    assert policy.resume(v) is step


@pytest.mark.parametrize("status, fault, again", [
    (PointStatus.QUEUED, None, False),  # queued already
    (PointStatus.RUNNING, None, True),  # its controller died
    (PointStatus.SUCCEEDED, None, False),
    (PointStatus.FAILED, Fault.JOB, False),
    (PointStatus.FAILED, Fault.FLEET, True),
    (PointStatus.FAILED, Fault.SETUP, True),
    (PointStatus.CANCELLED, None, True),
])
def test_runs_again(status: PointStatus, fault: Fault | None, again: bool) -> None:
    assert policy.runs_again(status, fault) is again


@pytest.mark.parametrize("points, status", [
    ([PointStatus.SUCCEEDED] * 3, SweepStatus.SUCCEEDED),
    ([PointStatus.SUCCEEDED, PointStatus.FAILED], SweepStatus.FAILED),
    ([PointStatus.SUCCEEDED, PointStatus.CANCELLED], SweepStatus.FAILED),
    ([], SweepStatus.SUCCEEDED),
])
def test_outcome(points: list[PointStatus], status: SweepStatus) -> None:
    assert policy.outcome(points) is status
