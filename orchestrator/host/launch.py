"""A run's job on its host: where its files are, its state as the host's agent reads it, starting and
stopping it through that agent.

The agent (the `hostjobs` package) starts the job under its own `wrap` mode as a session leader (setsid, with
SIGHUP ignored as under nohup): the wrapper records `pid start_time` (start time in clock ticks from
/proc, so a reused pid is never taken for the job), writes the combined stdout+stderr to `log`, and the
exit code to `.orch/exit_code`.
"""

from __future__ import annotations

import posixpath
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..config.checks import value_problem
from ..errors import OrchError
from ..store.record import JobRef
from . import agent
from .agent import data_of
from .hostjobs.common import CONTROL, JOB_MARK, TAIL_BYTES, TAIL_MARK
from .remote import Transport, env_exports, quote

# JOB_MARK: the mark the wrapper leaves in the environment of everything the job starts ("pid:start" of the
# wrapper), so members that outlive it can still be told from a later group that took the same id. CONTROL:
# orch's own files of a run (pid, exit code, start and end, token) are in a folder of the run dir, out of
# the way of a job that writes `./exit_code` or `./pid` in its working dir. Both are the host side's.

# An exit code read back is a C int (the wrapper writes one; a job could write anything over it).
EXIT_CODE_MAX = 2**31 - 1


@dataclass(frozen=True)
class RunPaths:
    """Every remote path of a run derives from here."""

    root: str

    def __post_init__(self) -> None:
        # An empty root would quote to '' and turn `cd` into a no-op: refuse it outright.
        if not self.root or not self.root.startswith("/"):
            raise OrchError(f"not an absolute remote run dir: {self.root!r}")

    @classmethod
    def for_run(cls, workdir: str, run_id: int, workspace: str | None = None) -> RunPaths:
        """`<workdir>/runs/<id>`, or `<workdir>/runs/<workspace>/<id>` where workspaces may share the workdir."""
        return cls(posixpath.join(workdir, "runs", *([workspace] if workspace else []), str(run_id)))

    @property
    def log(self) -> str:
        return posixpath.join(self.root, "log")

    @property
    def control(self) -> str:
        return posixpath.join(self.root, CONTROL)

    @property
    def pid(self) -> str:
        return posixpath.join(self.control, "pid")


def job_script(body: str, env: dict[str, str], cwd: str | None = None) -> str:
    """The script the wrapper runs: environment, working directory, then the job's own command lines."""
    head = "export PYTHONUNBUFFERED=1\n" + env_exports(env)
    if cwd:
        head += f"cd {quote(cwd)} || exit 97\n"
    return head + body.rstrip("\n") + "\n"


@dataclass
class JobState:
    alive: bool
    exit_code: int | None
    size: int  # log size in bytes
    offset: int  # where `data` starts (0 again after the log was truncated)
    data: bytes
    run_dir: bool = True  # the run dir still exists on the host
    started_at: float | None = None  # the job's own start and end (the host's clock), when known
    ended_at: float | None = None
    # What a batch scheduler adds: why the job still waits in its queue, the end it decided
    # ("TIMEOUT: ..."), the job's node.
    queued: str | None = None
    cause: str | None = None
    node: str | None = None
    # the wrapper itself lives; False while `alive` means its process group runs on without it
    wrapper: bool = True
    inode: int | None = None  # the identity of the file `data` is from
    rotated: bool = False  # `data` is the rest of a rotated log (`size` is that file's); the new one is next




def tail_mark(tail: bytes) -> str:
    """What the agent compares the bytes before its offset with: those bytes."""
    return tail[-TAIL_MARK:].hex()


def pushed_state(doc: dict[str, Any]) -> JobState:
    """The job's state as the agent said it (a push, or a read's answer)."""
    def num(key: str) -> float | None:
        # read from the run's own files, which its job may write: bounded as a spec's numbers are
        value = doc.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value_problem(value):
            return None
        return float(value)

    exit_code, inode, node = doc.get("exit_code"), doc.get("inode"), doc.get("node")
    return JobState(
        alive=bool(doc.get("alive")),
        exit_code=exit_code if isinstance(exit_code, int) and -EXIT_CODE_MAX <= exit_code <= EXIT_CODE_MAX else None,
        size=int(num("size") or 0), offset=int(num("offset") or 0), data=data_of(doc),
        run_dir=bool(doc.get("run_dir", True)), started_at=num("started_at"), ended_at=num("ended_at"),
        wrapper=bool(doc.get("wrapper", True)), inode=inode if isinstance(inode, int) else None,
        rotated=bool(doc.get("rotated")), node=node if isinstance(node, str) else None)


class HostExecutor:
    """A host's jobs (executor.Executor), driven through its agent: launched under the agent's wrapper, read,
    signalled only once proven theirs. Over `link` when given (the host's watcher holds one), else over the
    process's shared link to the host's agent (one per one-shot command)."""

    schedules_gpus: ClassVar[bool] = False
    queues: ClassVar[bool] = False
    processes: ClassVar[bool] = True

    def __init__(self, transport: Transport, link: agent.AgentLink | None = None):
        self.transport = transport
        self.link = link
        self.launch_facts: dict[str, Any] | None = None  # what the last launch saw on the host (receipts)

    def call(self, op: str, timeout: float = 60, **args: Any) -> dict[str, Any]:
        link = self.link if self.link is not None and self.link.alive else agent.shared(self.transport)
        return link.call(op, timeout=timeout, **args)

    def launch(self, paths: RunPaths, script: str, token: str, gpus: int | None = None, nodes: int = 1,
               facts: dict[str, Any] | None = None) -> JobRef:
        """Start the job through the host's agent (idempotent for the same token): its pid and start time.
        A host runs one node's job, whatever `nodes` says: each node of a run over SSH is launched apart.
        With `facts`, the same request looks at the host for the receipt first (kept in `launch_facts`)."""
        extra: dict[str, Any] = {"facts": facts} if facts is not None else {}
        job = self.call("launch", dir=paths.root, script=script, token=token, **extra)
        found = job.get("facts")
        self.launch_facts = found if isinstance(found, dict) else None
        return JobRef(int(job["pid"]), str(job["start"]))

    def find(self, paths: RunPaths) -> JobRef | None:
        found = self.call("find", dir=paths.root)["job"]
        return JobRef(int(found["pid"]), str(found["start"])) if found else None

    def poll(self, paths: RunPaths, job: JobRef, offset: int, max_bytes: int, hold_s: float = 0,
             wake: Sequence[str] = (), inode: int | None = None, mark: str | None = None) -> JobState:
        """Is the job alive, its exit code, and its log's bytes from `offset` (of the file with `inode`, when
        known: a rotated log is read to its end first; `mark`: tail_mark of the bytes before the offset).

        With `hold_s`, the agent first waits on the host until the job dies, a new log line matches one of
        `wake`, or the time is up. Liveness is read before the exit code, and both before the log, so a job
        seen dead has its last bytes in this same answer. A scheduler's job is alive by its scheduler's word,
        not here: only its run dir is read.
        """
        doc = self.call("read", timeout=hold_s + 60, dir=paths.root, pid=0 if job.scheduled else job.id,
                        start="" if job.scheduled else job.proof, offset=offset, max_bytes=max_bytes, inode=inode,
                        tail=mark or "", hold_s=hold_s, wake=list(wake), scheduled=job.scheduled)
        return pushed_state(doc)

    def kill(self, job: JobRef, grace_s: float) -> str:
        """Stop the job's whole process group: SIGTERM, a grace period, then SIGKILL, its identity proved
        again before each signal. 'gone' | 'stopped' | 'killed'."""
        return str(self.call("kill", timeout=grace_s + 30, pid=job.id, start=job.proof, grace_s=grace_s)["outcome"])

    def explain_loss(self, paths: RunPaths, job: JobRef) -> str | None:
        reason = self.call("loss", dir=paths.root, start=job.proof)["reason"]
        return str(reason) if reason else None

    def tail(self, paths: RunPaths, lines: int) -> str:
        return str(self.call("tail", path=paths.log, lines=lines)["text"])

    def judge(self, job: JobRef, state: JobState) -> JobState:
        return state  # the agent's word is the whole of it


__all__ = ["CONTROL", "JOB_MARK", "TAIL_BYTES", "TAIL_MARK", "HostExecutor", "JobState", "RunPaths", "job_script", "pushed_state", "tail_mark"]


def describe_exit(code: int) -> str:
    if code > 128:
        try:
            return f"exit code {code} (killed by {signal.Signals(code - 128).name})"
        except ValueError:
            pass
    return f"exit code {code}"
