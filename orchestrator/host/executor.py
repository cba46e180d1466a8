"""Where a run's job runs: the one small interface the run flow and the watcher drive a job through.

An executor starts a job script in its run dir, reports the job's state with the new bytes of its log,
and stops it. A job is named by a JobRef (on a host: the wrapper's pid and its start time; on a cluster: the
scheduler's job id and name). `launch.HostExecutor` runs jobs on a host over its transport (SSH, or this
machine) through its agent; `slurm.SlurmExecutor` submits them to a Slurm cluster.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from ..config.hosts import Host
from ..store.record import JobRef
from .launch import HostExecutor, JobState, RunPaths
from .remote import Transport
from .slurm import SlurmExecutor


class Executor(Protocol):
    """What the run flow and the watcher ask of a backend; `HostExecutor` and `slurm.SlurmExecutor` are the
    two there are."""

    transport: Transport
    # The scheduler allocates GPUs and cleans up after jobs: the run flow then does neither GPU cleanup
    # nor host leases.
    schedules_gpus: ClassVar[bool]
    # A job waits in the scheduler's queue before it runs: its run is `queued` until it leaves it.
    queues: ClassVar[bool]
    # Its jobs are processes of the host it reaches, which its agent starts and signals.
    processes: ClassVar[bool]
    # What the last launch saw on the host, when it was asked to look (see `launch`): for the receipt.
    launch_facts: dict[str, Any] | None

    def launch(self, paths: RunPaths, script: str, token: str, gpus: int | None = None, nodes: int = 1,
               facts: dict[str, Any] | None = None) -> JobRef:
        """Start the job (idempotent for the same token); its reference. `gpus`: how many a scheduler
        allocates (default: a node's all); a host's GPUs are chosen by the cleanup step instead. `nodes`:
        how many nodes a scheduler allocates to the one job, which runs the script on each. `facts`: what
        to look at on the host for the run's receipt, in the same request; the answer is `launch_facts`."""
        ...

    def find(self, paths: RunPaths) -> JobRef | None:
        """The job the run dir recorded, for a run whose controller died while launching."""
        ...

    def poll(self, paths: RunPaths, job: JobRef, offset: int, max_bytes: int, hold_s: float = 0, *,
             inode: int | None = None, mark: str | None = None) -> JobState:
        """Is the job alive, its exit code, and its log's bytes from `offset` (of the file with `inode`, when
        known: a rotated log is read to its end first; `mark`: launch.tail_mark of the bytes before it). May
        first wait up to `hold_s` for the job's end (the end's last read waits so for a job being stopped)."""
        ...

    def kill(self, job: JobRef, grace_s: float) -> str:
        """Stop the job, provably this one: 'gone' | 'stopped' | 'killed'. Every stop of a job goes here."""
        ...

    def explain_loss(self, paths: RunPaths, job: JobRef) -> str | None:
        """Why a job is gone without an exit code, as far as its host can tell (None: it cannot)."""
        ...

    def tail(self, paths: RunPaths, lines: int) -> str:
        ...

    def judge(self, job: JobRef, state: JobState) -> JobState:
        """A state its host's agent pushed, completed with what only the executor knows (a scheduler's view)."""
        ...


def executor_class(host: Host) -> type[HostExecutor | SlurmExecutor]:
    return SlurmExecutor if host.scheduler == "slurm" else HostExecutor


def executor_for(host: Host, transport: Transport) -> Executor:
    """The executor for a host of the inventory."""
    if executor_class(host) is SlurmExecutor:
        return SlurmExecutor(host, transport)
    return HostExecutor(transport)
