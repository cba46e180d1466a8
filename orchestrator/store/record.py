"""The typed record of a run, as the store holds it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .controller import Controller
from .encoding import decoded


class Status(StrEnum):
    PENDING = "pending"
    PREPARING = "preparing"
    LAUNCHING = "launching"
    QUEUED = "queued"  # submitted to a batch scheduler, waiting in its queue
    RUNNING = "running"
    # decided to end (cancelled, or a multi-node run's head failed) but its job not yet proven stopped: its
    # host did not answer; the lease stays until it does and the job is stopped (see runflow.ending.cancel)
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"  # the host says the process is gone and no exit code was written (e.g. a reboot)

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def live(self) -> bool:
        """The job was handed to its host or scheduler and has not ended: queued or running."""
        return self in (Status.QUEUED, Status.RUNNING, Status.CANCELLING)


TERMINAL = frozenset({Status.SUCCEEDED, Status.FAILED, Status.CANCELLED, Status.LOST})
ACTIVE = frozenset(Status) - TERMINAL

# The reasons of a run ended on purpose — `orch stop`, a run replacing it, another run's GPU cleanup —
# rather than cancelled as a mistake; both are `cancelled` to the lifecycle, `stopped` to a person.
STOPPED_REASONS = ("stopped by ", "replaced by ")
# Every status word a person reads and filters by (`orch status --status`, the dashboard): one per state.
STATUS_WORDS = (*(s.value for s in Status), "stopped")

_ENDINGS = {Status.FAILED, Status.CANCELLED}
ALLOWED: dict[Status, frozenset[Status]] = {
    Status.PENDING: frozenset({Status.PREPARING} | _ENDINGS),
    Status.PREPARING: frozenset({Status.LAUNCHING} | _ENDINGS),
    Status.LAUNCHING: frozenset({Status.QUEUED, Status.RUNNING, Status.LOST} | _ENDINGS),
    # a job may end between two looks at the queue, never seen running
    Status.QUEUED: frozenset({Status.RUNNING, Status.SUCCEEDED, Status.LOST, Status.CANCELLING} | _ENDINGS),
    Status.RUNNING: frozenset({Status.SUCCEEDED, Status.LOST, Status.CANCELLING} | _ENDINGS),
    # it ends as decided (`ending_as`) once its job is stopped or seen gone; lost if its host never answers
    Status.CANCELLING: frozenset({Status.LOST} | _ENDINGS),
    **{s: frozenset() for s in TERMINAL},
}


# Columns stored as JSON text.
JSON_FIELDS = ("spec", "parser_state", "progress", "error", "end_steps", "end_claims", "patches_applied",
               "tags", "receipt")


KILL_GRACE_S = 10.0  # between SIGTERM and SIGKILL, wherever orch stops a job or a process on its GPUs


@dataclass(frozen=True)
class JobRef:
    """A run's job, named with its proof: a process of its host (its pid and start time, so that a later
    process given the same pid is never taken for it), or a batch scheduler's job (its id and name, so that
    a job given the same id after the cluster's state was reset is not either)."""

    id: int
    proof: str
    scheduled: bool = False  # a scheduler's job, not a process of the host

    def __str__(self) -> str:
        return f"Slurm job {self.id}" if self.scheduled else f"pid {self.id}"

    def columns(self) -> dict[str, Any]:
        """Where the run's row keeps it."""
        if self.scheduled:
            return {"job_id": self.id, "job_name": self.proof}
        return {"pid": self.id, "pid_start": self.proof}


# Epoch seconds up to the year 2286: what every date, duration and JSON document can hold.
TIME_MAX = 1e10
_TIMES = ("created_at", "started_at", "ended_at", "heartbeat", "progress_at", "predicted_at")


def a_time(value: Any) -> float | None:
    """A stored time as a time: None for anything else (not a number, not finite, out of range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if 0 <= value <= TIME_MAX else None  # False for nan too


@dataclass
class RunRecord:
    id: int
    playbook: str
    host: str
    status: Status
    phase: str | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    pid: int | None = None  # a process of the host: its pid and start time (see JobRef)
    pid_start: str | None = None
    remote_dir: str | None = None
    log_offset: int = 0
    parser_state: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    reason: str | None = None
    stalled: bool = False
    watcher: str | None = None  # Controller text of whoever polled it last
    heartbeat: float | None = None
    progress_at: float | None = None
    predicted_at: float | None = None
    sweep_id: int | None = None
    point: str | None = None
    last_line: str | None = None  # the log's last line as of the last poll
    host_lease: bool = False  # it holds lease files on its host (host/hostlease.py)
    end_steps: list[str] = field(default_factory=list)  # the end steps that already ran
    ending_as: str | None = None  # a cancelling run: the status it ends with once its job is stopped
    end_claims: dict[str, Any] = field(default_factory=dict)  # of those, the ones under way: who runs each, since when
    patches_applied: list[str] = field(default_factory=list)  # patch sets this run applied on its host
    unreadable: list[str] = field(default_factory=list)  # JSON columns found damaged (read as None)
    node: str | None = None  # a scheduler's: the job's node(s)
    queue_reason: str | None = None  # a scheduler's: why the job still waits in its queue
    log_inode: int | None = None  # the inode of the log file `log_offset` is in
    log_tail: str | None = None  # the log's last bytes before `log_offset`, hex
    name: str | None = None  # a person's name for the run
    tags: list[str] = field(default_factory=list)
    note: str | None = None  # a person's notes, one a line
    job_id: int | None = None  # a scheduler's job: its id and name (see JobRef)
    job_name: str | None = None
    # A multi-node run is one record per node: its head (rank 0) is the run; each other node's record
    # names the head as its parent and has a rank of its own.
    parent_id: int | None = None
    node_rank: int | None = None
    # What produced the run's numbers (see store/receipts.py), and why they do not count when they do not:
    # a flag beside the status, which keeps saying what happened to the job.
    receipt: dict[str, Any] | None = None
    invalid: str | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> RunRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in row.items() if k in known}
        values["status"] = Status(values["status"])
        values["stalled"] = bool(values.get("stalled"))
        values["host_lease"] = bool(values.get("host_lease"))
        for key in ("spec", "end_claims"):
            values[key] = values.get(key) or {}
        for key in ("end_steps", "patches_applied", "tags", "unreadable"):
            values[key] = list(values.get(key) or [])
        values["log_offset"] = values.get("log_offset") or 0
        for key in _TIMES:  # one a job's files once put there (inf, 1e300) reads as unknown, not as a crash
            if key in values:
                values[key] = a_time(values[key])
        values["created_at"] = values.get("created_at") or 0.0
        return cls(**values)

    @property
    def job(self) -> JobRef | None:
        """Its job, once launched."""
        if self.job_id is not None:
            return JobRef(self.job_id, self.job_name or "", scheduled=True)
        if self.pid is not None:
            return JobRef(self.pid, self.pid_start or "")
        return None

    @property
    def launched(self) -> bool:
        return self.job is not None

    @property
    def point_diff(self) -> dict[str, Any] | None:
        """A sweep's run: its point's spec differences (None: not a sweep's, or the column is damaged)."""
        return decoded(self.point)

    @property
    def watched_by(self) -> Controller | None:
        return Controller.parse(self.watcher)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return d
