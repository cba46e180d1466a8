"""Where a run's job runs: the one small interface the run flow and the watcher drive a job through.

An executor starts a job script in its run dir, reports the job's state with the new bytes of its log,
and stops it. A job is named by a JobRef (on a host: the wrapper's pid and its start time; on a cluster: the
scheduler's job id and name). `HostExecutor` runs jobs on a host over its transport (SSH, or this
machine) through its agent; `SlurmExecutor` submits them to a Slurm cluster (slurm.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..config.hosts import Host
from ..store.record import JobRef
from . import agent, slurm
from .agent import AgentLink
from .launch import JobState, RunPaths, pushed_state, read_state
from .remote import Transport

__all__ = ["Executor", "HostExecutor", "SlurmExecutor", "executor_for", "pushed_state"]


class Executor:
    transport: Transport
    # The scheduler allocates GPUs and cleans up after jobs: the run flow then does neither GPU cleanup
    # nor host leases.
    schedules_gpus = False
    # The host's agent pushes the job's log and end as they happen to one watcher per host (hostwatch.py);
    # otherwise each run is polled by a watcher of its own.
    streams = False
    # A job waits in the scheduler's queue before it runs: its run is `queued` until it leaves it.
    queues = False
    # Its jobs are processes of the host it reaches, which its agent starts and signals.
    processes = False

    def launch(self, paths: RunPaths, script: str, token: str, gpus: int | None = None) -> JobRef:
        """Start the job (idempotent for the same token); its reference. `gpus`: how many a scheduler
        allocates (default: a node's all); a host's GPUs are chosen by the cleanup step instead."""
        raise NotImplementedError

    def find(self, paths: RunPaths) -> JobRef | None:
        """The job the run dir recorded, for a run whose controller died while launching."""
        raise NotImplementedError

    def poll(self, paths: RunPaths, job: JobRef, offset: int, max_bytes: int, hold_s: float = 0,
             wake: Sequence[str] = (), inode: int | None = None,
             mark: str | None = None) -> JobState:
        """Is the job alive, its exit code, and its log's bytes from `offset` (of the file with `inode`, when
        known: a rotated log is read to its end first; `mark`: launch.tail_mark of the bytes before it). May first wait up to `hold_s` for news: the job's
        end, or a new log line matching any of the regular expressions `wake`."""
        raise NotImplementedError

    def kill(self, job: JobRef, grace_s: float) -> str:
        """Stop the job, provably this one: 'gone' | 'stopped' | 'killed'."""
        raise NotImplementedError

    def explain_loss(self, paths: RunPaths, job: JobRef) -> str | None:
        """Why a job is gone without an exit code, as far as its host can tell (None: it cannot)."""
        return None

    def tail(self, paths: RunPaths, lines: int) -> str:
        raise NotImplementedError

    def judge(self, job: JobRef, state: JobState) -> JobState:
        """A state its host's agent pushed, completed with what only the executor knows (a scheduler's view)."""
        return state


class HostExecutor(Executor):
    """A host's jobs, driven through its agent: launched under the agent's wrapper, read, signalled only
    once proven theirs. Over `link` when given (the host's watcher holds one), else over the process's
    shared link to the host's agent (one per one-shot command)."""

    streams = True
    processes = True

    def __init__(self, transport: Transport, link: AgentLink | None = None):
        self.transport = transport
        self.link = link

    def call(self, op: str, timeout: float = 60, **args: Any) -> dict[str, Any]:
        link = self.link if self.link is not None and self.link.alive else agent.shared(self.transport)
        return link.call(op, timeout=timeout, **args)

    def launch(self, paths: RunPaths, script: str, token: str, gpus: int | None = None) -> JobRef:
        job = self.call("launch", dir=paths.root, script=script, token=token)
        return JobRef(int(job["pid"]), str(job["start"]))

    def find(self, paths: RunPaths) -> JobRef | None:
        found = self.call("find", dir=paths.root)["job"]
        return JobRef(int(found["pid"]), str(found["start"])) if found else None

    def poll(self, paths: RunPaths, job: JobRef, offset: int, max_bytes: int, hold_s: float = 0,
             wake: Sequence[str] = (), inode: int | None = None,
             mark: str | None = None) -> JobState:
        return read_state(self.call, paths, job, offset, max_bytes, hold_s, list(wake), inode, mark)

    def kill(self, job: JobRef, grace_s: float) -> str:
        return str(self.call("kill", timeout=grace_s + 30, pid=job.id, start=job.proof, grace_s=grace_s)["outcome"])

    def explain_loss(self, paths: RunPaths, job: JobRef) -> str | None:
        reason = self.call("loss", dir=paths.root, start=job.proof)["reason"]
        return str(reason) if reason else None

    def tail(self, paths: RunPaths, lines: int) -> str:
        return str(self.call("tail", path=paths.log, lines=lines)["text"])



class SlurmExecutor(Executor):
    schedules_gpus = True
    queues = True
    streams = True  # the login node's agent follows the job's log on the shared filesystem

    def __init__(self, host: Host, transport: Transport):
        self.host, self.transport = host, transport

    def launch(self, paths: RunPaths, script: str, token: str, gpus: int | None = None) -> JobRef:
        return slurm.submit(self.transport, self.host, paths, script, token, self.host.gpus if gpus is None else gpus)

    def find(self, paths: RunPaths) -> JobRef | None:
        return slurm.find(self.transport, paths)

    def poll(self, paths: RunPaths, job: JobRef, offset: int, max_bytes: int, hold_s: float = 0,
             wake: Sequence[str] = (), inode: int | None = None,
             mark: str | None = None) -> JobState:
        # the scheduler is asked once per round for all jobs, so the hold is spent here, not on a node
        return slurm.read_state(self.transport, paths, job, offset, max_bytes, hold_s, inode, mark)

    def kill(self, job: JobRef, grace_s: float) -> str:
        return slurm.cancel(self.transport, job, grace_s)

    def judge(self, job: JobRef, state: JobState) -> JobState:
        """A state the login node's agent pushed, with the scheduler's view laid over it."""
        return slurm.judge(self.transport, job, state, slurm.lookup(self.transport, job))

    def tail(self, paths: RunPaths, lines: int) -> str:
        return str(agent.call(self.transport, "tail", path=paths.log, lines=lines)["text"])


def executor_class(host: Host) -> type[Executor]:
    return SlurmExecutor if host.scheduler == "slurm" else HostExecutor


def executor_for(host: Host, transport: Transport) -> Executor:
    """The executor for a host of the inventory."""
    if executor_class(host) is SlurmExecutor:
        return SlurmExecutor(host, transport)
    return HostExecutor(transport)
