"""Where a run's job runs: the one small interface the run flow and the watcher drive a job through.

An executor starts a job script in its run dir, reports the job's state with the new bytes of its log,
and stops it. A job is named by a handle of two values the executor gives meaning to (on a host: the
wrapper's pid and its start time). `HostExecutor` runs jobs on a host over its transport (SSH, or this
machine) under `setsid nohup`; `SlurmExecutor` submits them to a Slurm cluster (slurm.py).
"""

from __future__ import annotations

import posixpath

from . import launch, slurm
from .agent import AgentLink, data_of
from .hosts import Host
from .launch import JobState, RunPaths
from .remote import Transport, quote

Handle = tuple[int, str]


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

    def launch(self, paths: RunPaths, script: str, token: str, gpus: int | None = None) -> Handle:
        """Start the job (idempotent for the same token); its handle. `gpus`: how many a scheduler
        allocates (default: a node's all); a host's GPUs are chosen by the cleanup step instead."""
        raise NotImplementedError

    def find(self, paths: RunPaths) -> Handle | None:
        """The handle the run dir recorded, for a run whose controller died while launching."""
        raise NotImplementedError

    def describe(self, handle: Handle) -> str:
        return f"pid {handle[0]}"

    def poll(self, paths: RunPaths, handle: Handle, offset: int, max_bytes: int, hold_s: float = 0,
             wake: str | None = None, wake_perl: str | None = None, inode: int | None = None,
             mark: str | None = None) -> JobState:
        """Is the job alive, its exit code, and its log's bytes from `offset` (of the file with `inode`, when
        known: a rotated log is read to its end first; `mark`: launch.tail_mark of the bytes before it). May first wait up to `hold_s` for news: the job's
        end, or a new log line matching `wake` (extended regex) or `wake_perl`."""
        raise NotImplementedError

    def kill(self, handle: Handle, grace_s: float) -> str:
        """Stop the job, provably this one: 'gone' | 'stopped' | 'killed'."""
        raise NotImplementedError

    def explain_loss(self, paths: RunPaths, handle: Handle) -> str | None:
        """Why a job is gone without an exit code, as far as its host can tell (None: it cannot)."""
        return None

    def tail(self, paths: RunPaths, lines: int) -> str:
        raise NotImplementedError

    def judge(self, handle: Handle, state: JobState) -> JobState:
        """A state its host's agent pushed, completed with what only the executor knows (a scheduler's view)."""
        return state


class HostExecutor(Executor):
    streams = True
    processes = True

    def __init__(self, transport: Transport):
        self.transport = transport

    def launch(self, paths: RunPaths, script: str, token: str, gpus: int | None = None) -> Handle:
        return launch.launch(self.transport, paths, script, token)

    def find(self, paths: RunPaths) -> Handle | None:
        old = posixpath.join(paths.root, "pid")  # a run dir from before the control folder
        fields = self.transport.run(f"cat {quote(paths.pid)} 2>/dev/null || cat {quote(old)} 2>/dev/null || true",
                                    timeout=60).stdout.split()
        return (int(fields[0]), fields[1]) if len(fields) == 2 and fields[0].isdigit() else None

    def poll(self, paths: RunPaths, handle: Handle, offset: int, max_bytes: int, hold_s: float = 0,
             wake: str | None = None, wake_perl: str | None = None, inode: int | None = None,
             mark: str | None = None) -> JobState:
        return launch.read_state(self.transport, paths, handle[0], handle[1], offset, max_bytes, hold_s=hold_s,
                                 wake=wake, wake_perl=wake_perl, inode=inode, mark=mark)

    def kill(self, handle: Handle, grace_s: float) -> str:
        return launch.kill(self.transport, handle[0], handle[1], grace_s)

    def explain_loss(self, paths: RunPaths, handle: Handle) -> str | None:
        return launch.explain_loss(self.transport, paths, handle[1])

    def tail(self, paths: RunPaths, lines: int) -> str:
        return self.transport.run(launch.tail_command(paths, lines), timeout=60).stdout


class SlurmExecutor(Executor):
    schedules_gpus = True
    queues = True
    streams = True  # the login node's agent follows the job's log on the shared filesystem

    def __init__(self, host: Host, transport: Transport):
        self.host, self.transport = host, transport

    def launch(self, paths: RunPaths, script: str, token: str, gpus: int | None = None) -> Handle:
        return slurm.submit(self.transport, self.host, paths, script, token, self.host.gpus if gpus is None else gpus)

    def find(self, paths: RunPaths) -> Handle | None:
        return slurm.find(self.transport, paths)

    def describe(self, handle: Handle) -> str:
        return f"Slurm job {handle[0]}"

    def poll(self, paths: RunPaths, handle: Handle, offset: int, max_bytes: int, hold_s: float = 0,
             wake: str | None = None, wake_perl: str | None = None, inode: int | None = None,
             mark: str | None = None) -> JobState:
        # the scheduler is asked once per round for all jobs, so the hold is spent here, not on a node
        return slurm.read_state(self.transport, paths, handle, offset, max_bytes, hold_s)

    def kill(self, handle: Handle, grace_s: float) -> str:
        return slurm.cancel(self.transport, handle, grace_s)

    def judge(self, handle: Handle, state: JobState) -> JobState:
        """A state the login node's agent pushed, with the scheduler's view laid over it."""
        return slurm.judge(self.transport, handle, state, slurm.lookup(self.transport, handle))

    def tail(self, paths: RunPaths, lines: int) -> str:
        return self.transport.run(launch.tail_command(paths, lines), timeout=60).stdout


class AgentExecutor(HostExecutor):
    """A host's jobs driven through its running agent: signals, lookups and tails are requests on the
    agent's channel instead of shell commands (while the agent is not there, the shell's)."""

    def __init__(self, transport: Transport, link: AgentLink | None):
        super().__init__(transport)
        self.link = link

    def _agent(self) -> AgentLink | None:
        return self.link if self.link is not None and self.link.alive else None

    def launch(self, paths: RunPaths, script: str, token: str, gpus: int | None = None) -> Handle:
        if (link := self._agent()) is None:
            return super().launch(paths, script, token, gpus)
        job = link.call("launch", dir=paths.root, script=script, wrapper=launch.WRAPPER, token=token)
        return int(job["pid"]), str(job["start"])

    def find(self, paths: RunPaths) -> Handle | None:
        if (link := self._agent()) is None:
            return super().find(paths)
        job = link.call("find", dir=paths.root)["job"]
        return (int(job["pid"]), str(job["start"])) if job else None

    def kill(self, handle: Handle, grace_s: float) -> str:
        if (link := self._agent()) is None:
            return super().kill(handle, grace_s)
        return str(link.call("kill", timeout=grace_s + 30, pid=handle[0], start=handle[1], grace_s=grace_s)["outcome"])

    def explain_loss(self, paths: RunPaths, handle: Handle) -> str | None:
        if (link := self._agent()) is None:
            return super().explain_loss(paths, handle)
        reason = link.call("loss", dir=paths.root, start=handle[1])["reason"]
        return str(reason) if reason else None

    def tail(self, paths: RunPaths, lines: int) -> str:
        if (link := self._agent()) is None:
            return super().tail(paths, lines)
        return str(link.call("tail", path=paths.log, lines=lines)["text"])


def pushed_state(doc: dict[str, object]) -> JobState:
    """The job's state as the agent pushed it."""
    def num(key: str) -> float | None:
        value = doc.get(key)
        return float(value) if isinstance(value, (int, float)) else None

    exit_code, inode, node = doc.get("exit_code"), doc.get("inode"), doc.get("node")
    return JobState(
        alive=bool(doc.get("alive")), exit_code=exit_code if isinstance(exit_code, int) else None,
        size=int(num("size") or 0), offset=int(num("offset") or 0), data=data_of(doc),
        run_dir=bool(doc.get("run_dir", True)), started_at=num("started_at"), ended_at=num("ended_at"),
        wrapper=bool(doc.get("wrapper", True)), inode=inode if isinstance(inode, int) else None,
        rotated=bool(doc.get("rotated")), node=node if isinstance(node, str) else None)


def executor_class(host: Host) -> type[Executor]:
    return SlurmExecutor if host.scheduler == "slurm" else HostExecutor


def executor_for(host: Host, transport: Transport) -> Executor:
    """The executor for a host of the inventory."""
    if executor_class(host) is SlurmExecutor:
        return SlurmExecutor(host, transport)
    return HostExecutor(transport)
