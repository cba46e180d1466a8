"""The typed records of a sweep and its points: statuses, their allowed transitions, faults, rows."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..store.controller import Controller

# A controller on another machine is taken for dead after this long without a stamp: its watchers may
# poll as rarely as the longest default poll interval (600 s).
CONTROLLER_STALE_S = 3 * 600.0


class SweepStatus(StrEnum):
    QUEUED = "queued"  # registered; no controller has claimed it yet
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self in (SweepStatus.SUCCEEDED, SweepStatus.FAILED, SweepStatus.CANCELLED)


# An ended sweep is not final: running its file again resumes it.
SWEEP_ALLOWED: dict[SweepStatus, frozenset[SweepStatus]] = {
    SweepStatus.QUEUED: frozenset({SweepStatus.RUNNING, SweepStatus.CANCELLED}),
    SweepStatus.RUNNING: frozenset({SweepStatus.SUCCEEDED, SweepStatus.FAILED, SweepStatus.CANCELLED}),
    SweepStatus.SUCCEEDED: frozenset({SweepStatus.RUNNING}),
    SweepStatus.FAILED: frozenset({SweepStatus.RUNNING}),
    SweepStatus.CANCELLED: frozenset({SweepStatus.RUNNING}),
}

# Shown, never stored: a sweep `running` whose controller died. Running its file again resumes it.
INTERRUPTED = "interrupted"


class PointStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # a searching sweep's: stopped early by the pruner, a loser by its live metrics; or it ran to its end
    # and broke a bound of [constraints]. Both finished for good, as succeeded is.
    PRUNED = "pruned"
    INFEASIBLE = "infeasible"


_SEARCH_ENDS = frozenset({PointStatus.PRUNED, PointStatus.INFEASIBLE})
POINT_ALLOWED: dict[PointStatus, frozenset[PointStatus]] = {
    # succeeded / failed straight from queued: the run an earlier controller left had already ended
    PointStatus.QUEUED: frozenset({PointStatus.RUNNING, PointStatus.CANCELLED, PointStatus.SUCCEEDED,
                                   PointStatus.FAILED} | _SEARCH_ENDS),
    # queued again: a retry, or its controller died and a new one takes the point over
    PointStatus.RUNNING: frozenset({PointStatus.QUEUED, PointStatus.SUCCEEDED, PointStatus.FAILED,
                                    PointStatus.CANCELLED} | _SEARCH_ENDS),
    PointStatus.SUCCEEDED: frozenset(),
    PointStatus.PRUNED: frozenset(),
    PointStatus.INFEASIBLE: frozenset(),
    # a new run of the sweep runs again what did not finish (never a job's own failure: see claim)
    PointStatus.FAILED: frozenset({PointStatus.QUEUED}),
    PointStatus.CANCELLED: frozenset({PointStatus.QUEUED}),
}


class Fault(StrEnum):
    """Whose fault a failed point is."""

    JOB = "job"  # the job ran and failed: never retried, never run again
    FLEET = "fleet"  # unreachable host, lost job: retried
    SETUP = "setup"  # refused before launch: retrying would meet it again


@dataclass(frozen=True)
class SweepRow:
    id: int
    name: str
    instance: str
    file_hash: str
    path: str | None
    playbook: str
    status: SweepStatus
    controller: Controller | None
    heartbeat: float | None
    created_at: float
    ended_at: float | None
    notify: list[str]
    doc: dict[str, Any] | None = None  # the sweep file as it was parsed when the sweep was registered

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SweepRow:
        """From the store's row (store.sweeps), its JSON read."""
        return cls(row["id"], row["name"], row["instance"], row["file_hash"], row["path"], row["playbook"],
                   SweepStatus(row["status"]), Controller.parse(row["controller"]), row["heartbeat"],
                   row["created_at"], row["ended_at"], list(row["notify"] or []), row["doc"])

    def controller_alive(self, now: float | None = None) -> bool:
        return self.controller is not None and self.controller.alive(self.heartbeat, CONTROLLER_STALE_S, now)


@dataclass(frozen=True)
class PointRow:
    sweep_id: int
    index: int
    key: str  # JSON of the point's spec differences, as runs.point holds it
    host: str
    gpus: list[int] | None
    status: PointStatus
    fault: Fault | None
    reason: str | None
    attempts: int
    run_id: int | None
    diff: dict[str, Any]  # the point's spec differences: `key` read

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> PointRow:
        """From the store's row (store.sweeps), its JSON read."""
        return cls(row["sweep_id"], row["idx"], row["point"], row["host"], row["gpus"],
                   PointStatus(row["status"]), Fault(row["fault"]) if row["fault"] else None, row["reason"],
                   row["attempts"] or 0, row["run_id"], dict(row["diff"]))
