"""Jobs on a Slurm cluster: submitted with sbatch, watched through one batched queue query per round.

The cluster is reached through its login node's agent (over SSH, or on this machine when the host has no
address), which runs sbatch, squeue, sacct, scancel and sinfo as argv lists and answers in JSON; run dirs
live under the host's workdir on the filesystem the nodes share, so the job's log, pid and exit code are
read there exactly as on a host. The batch script starts the agent's own wrapper (pid and start time on
the node, combined log, exit code), so every playbook's job script runs unchanged.

A job is named by its id and its name (a JobRef): the name guards against a job id reused after the
cluster's state was reset. The scheduler owns the GPUs: a job asks for a count (`--gres=gpu:N`), Slurm sets
CUDA_VISIBLE_DEVICES and cleans up after the job, so orch neither cleans GPUs nor leases the host.

A run of N nodes is one job of N nodes (`--nodes=N --ntasks-per-node=1`), still one run: the wrapper runs on
the first node, where its job script (`node_script`) starts the job's own lines once per node through
`srun --kill-on-bad-exit=1` (a node that fails ends the job, so the run fails), each with NODE_ENV from
Slurm's own variables. srun's `--label` puts each node's rank in front of its lines ('1: '), which the log
parser peels: lines of different nodes never splice, and the head's read as if alone.

Every watcher of a cluster in this process shares one `Queue`: whatever the number of runs, a poll
round costs one `squeue` (plus one `sacct` for jobs that already left squeue's memory). The agent reads
their text formats (`-o '%i|%T|...'`, `-P`) rather than `--json`, whose schema changes between Slurm
releases; lines that do not parse are skipped.
"""

from __future__ import annotations

import posixpath
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..config.hosts import Host
from ..errors import OrchError, Unreachable
from ..store.record import JobRef
from . import agent, session
from .agent import AgentError
from .launch import HostExecutor, JobState, RunPaths
from .polling import queue_query_s
from .remote import Transport

# Job states (squeue %T / sacct State); anything not listed as ended counts as still in the system.
QUEUED = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT"})
# Ends the scheduler decided: the run ends with this cause whatever the job's own exit code says.
CAUSES = {
    "TIMEOUT": "the job reached its time limit",
    "NODE_FAIL": "its node failed",
    "PREEMPTED": "preempted by another job",
    "OUT_OF_MEMORY": "out of memory (the job's memory limit)",
    "CANCELLED": "cancelled in Slurm (scancel)",
    "BOOT_FAIL": "its node failed to boot",
    "DEADLINE": "the job reached its deadline",
}
EXIT_CODE_WAIT_S = 10.0  # after the scheduler says a job ended, how long its exit code may take to show


def job_name(paths: RunPaths) -> str:
    return f"orch-{posixpath.basename(paths.root)}"


def sbatch_args(host: Host, paths: RunPaths, gpus: int, nodes: int = 1) -> list[str]:
    """sbatch's options for a run: where it runs, what it asks for (`gpus` on each of its `nodes`); each one
    argument of sbatch's argv."""
    args = [f"--job-name={job_name(paths)}", f"--chdir={paths.root}", f"--output={paths.root}/slurm.out",
            f"--nodes={int(nodes)}"]
    if nodes > 1:
        args.append("--ntasks-per-node=1")
    if gpus:
        args.append(f"--gres=gpu:{int(gpus)}")
    for option, value in (("partition", host.partition), ("account", host.account), ("qos", host.qos),
                          ("time", host.time_limit), ("constraint", host.constraint)):
        if value:
            args.append(f"--{option}={value}")
    return args + list(host.sbatch_args)


# MASTER_PORT (unless the run's env sets one): one per job id, so that two jobs sharing a head node differ;
# the head moves past a port something there already listens on.
PORT_BASE, PORT_SPAN, PORT_TRIES = 15000, 20000, 50
NODE_TASK = "ORCH_NODE_TASK"  # set in the tasks srun starts: the script runs the job's lines, not srun again

NODE_PRELUDE = f"""\
# One Slurm job of several nodes: in the batch step (on the first node) this script starts itself once per
# node through srun; each of those tasks runs the lines below with its node's rank.
if [ -z "${{{NODE_TASK}:-}}" ]; then
    export NNODES="${{SLURM_JOB_NUM_NODES:-$SLURM_NNODES}}"
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    export MASTER_ADDR="${{MASTER_ADDR:-$SLURMD_NODENAME}}"
    # the batch step runs on the first node, the head: a port something there answers on is taken
    MASTER_PORT=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))
    for _ in $(seq {PORT_TRIES}); do
        (exec 3<>"/dev/tcp/127.0.0.1/$MASTER_PORT") 2>/dev/null || break
        MASTER_PORT=$(( {PORT_BASE} + (MASTER_PORT - {PORT_BASE} + 1) % {PORT_SPAN} ))
    done
    export MASTER_PORT
    export {NODE_TASK}=1
    exec srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 --label \\
        bash "$0"
fi
export NODE_RANK="$SLURM_NODEID"
"""


def node_script(script: str, nodes: int) -> str:
    """The job script of a run on `nodes` nodes: one node's is the script itself; several nodes' runs it
    once per node through srun, with NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT (NODE_ENV) set from
    Slurm's variables. Lines of the script that export one of them (the run's own env) come after, so win."""
    return script if nodes <= 1 else NODE_PRELUDE + script


def parse_job_id(text: str) -> int:
    """`--parsable` prints `id` or `id;cluster`."""
    head = text.strip().splitlines()[-1].split(";")[0].strip() if text.strip() else ""
    if not head.isdigit():
        raise OrchError(f"sbatch printed no job id: {text.strip()[:200]!r}")
    return int(head)


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str  # the base state: "CANCELLED by 0" and "RUNNING+" are CANCELLED and RUNNING
    node: str | None
    name: str | None
    reason: str | None
    exit_code: int | None = None  # sacct's, when squeue no longer knows the job

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def queued(self) -> bool:
        return self.state in QUEUED


def _state(text: str) -> str:
    return text.strip().split()[0].rstrip("+").upper() if text.strip() else "UNKNOWN"


def _blank(text: str) -> str | None:
    text = text.strip()
    return None if text in ("", "None", "(null)", "n/a", "None assigned") or text.startswith("(") else text


def parse_squeue(rows: list[dict[str, str]]) -> dict[str, JobInfo]:
    """The agent's squeue rows (`%i|%T|%N|%j|%r`, cut into their fields) as jobs by id."""
    jobs: dict[str, JobInfo] = {}
    for row in rows:
        job_id = str(row.get("job_id", "")).strip()
        if job_id:
            jobs[job_id] = JobInfo(job_id, _state(str(row.get("state", ""))), _blank(str(row.get("node", ""))),
                                   str(row.get("name", "")).strip() or None, _blank(str(row.get("reason", ""))))
    return jobs


def parse_sacct(rows: list[dict[str, str]]) -> dict[str, JobInfo]:
    """The agent's sacct rows (`JobIDRaw,State,NodeList,JobName,ExitCode`); ExitCode is `code:signal`."""
    jobs: dict[str, JobInfo] = {}
    for row in rows:
        job_id = str(row.get("job_id", "")).strip()
        if not job_id.isdigit():
            continue
        code, _, signal = str(row.get("exit_code", "")).partition(":")
        value = int(code) if code.isdigit() else None
        if value == 0 and signal.isdigit() and int(signal):
            value = 128 + int(signal)
        jobs[job_id] = JobInfo(job_id, _state(str(row.get("state", ""))), _blank(str(row.get("node", ""))),
                               str(row.get("name", "")).strip() or None, None, value)
    return jobs


class Queue:
    """What the scheduler says about every job this process watches on one cluster, asked once per round.

    A caller gets an answer no older than `interval_s`; the first caller of a round asks, the others wait
    for its answer and share it. Ended jobs are remembered, since a
    job gone from squeue never comes back.
    """

    def __init__(self, transport: Transport, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.transport, self.interval_s, self.clock = transport, interval_s, clock
        self.cond = threading.Condition()
        self.jobs: dict[str, JobInfo] = {}
        self.ended: dict[str, JobInfo] = {}
        self.ended_seen: dict[str, float] = {}  # job id -> when an answer first said it ended
        self.watched: dict[str, float] = {}  # job id -> when it was first looked up
        self.asked_at: float | None = None  # when the last answer's query began
        self.asking = False
        self.calls = 0  # scheduler commands run (squeue and sacct), for the benchmark and tests

    def lookup(self, job_id: str) -> JobInfo | None:
        """The job as the scheduler saw it this round; None when it knows nothing of it."""
        with self.cond:
            self.watched.setdefault(job_id, self.clock())
            while True:
                if job_id in self.ended:
                    return self.ended[job_id]
                # an answer of this round serves; one without the job only if asked after the job was
                # first looked up (a job submitted since is not in it yet)
                fresh = self.asked_at is not None and self.clock() - self.asked_at < self.interval_s and (
                    job_id in self.jobs or self.asked_at >= self.watched[job_id])
                if fresh:
                    return self.jobs.get(job_id)
                if not self.asking:
                    break
                self.cond.wait()
            self.asking = True
        try:
            agent.shared(self.transport)  # the link up first: starting the agent is no part of the answer's age
            started = self.clock()
            jobs = self._ask()
        finally:
            with self.cond:
                self.asking = False
                self.cond.notify_all()
        with self.cond:
            self.jobs, self.asked_at = jobs, started
            for k, v in jobs.items():
                if v.ended and k in self.watched and k not in self.ended:
                    self.ended[k], self.ended_seen[k] = v, self.clock()
            return self.ended.get(job_id) or self.jobs.get(job_id)

    def wait(self, job_id: str, hold_s: float, sleep: Callable[[float], None] = time.sleep) -> JobInfo | None:
        """The job's state, after waiting up to `hold_s` for it to change (leave the queue, end)."""
        first = self.lookup(job_id)
        deadline = self.clock() + hold_s
        now = first
        while not (now and now.ended) and self.clock() < deadline:
            sleep(min(self.interval_s, max(deadline - self.clock(), 0)))
            now = self.lookup(job_id)
            if (now and now.state) != (first and first.state):
                break
        return now

    def forget(self, job_id: str) -> None:
        with self.cond:
            self.watched.pop(job_id, None)

    def _ask(self) -> dict[str, JobInfo]:
        """One squeue for every job of this user (finished ones too, while Slurm keeps them), then one
        sacct for the watched jobs squeue no longer lists."""
        self.calls += 1
        try:
            jobs = parse_squeue(agent.call(self.transport, "squeue")["jobs"])
        except AgentError as exc:
            # a controller restarting or overloaded: the watcher tries again later, as for a host offline
            raise Unreachable(self.transport.host.name, exc.message) from None
        gone = sorted(k for k in self.watched if k not in jobs and k not in self.ended)
        if gone:
            jobs.update(self._accounting(gone))
        return jobs

    def _accounting(self, ids: list[str]) -> dict[str, JobInfo]:
        """sacct from the accounting database, else (no slurmdbd) from the job-completion file."""
        self.calls += 1
        wanted = [int(i) for i in ids if i.isdigit()]
        return parse_sacct(agent.call(self.transport, "sacct", ids=wanted)["jobs"])


_queues_lock = threading.Lock()


def queue_for(transport: Transport) -> Queue:
    """The one queue of a cluster in this process."""
    queues = session.current().queues
    with _queues_lock:
        q = queues.get(transport.host.name)
        if q is None or q.transport.host != transport.host:
            q = queues[transport.host.name] = Queue(transport, queue_query_s(transport.host))
        return q



class SlurmExecutor(HostExecutor):
    """A Slurm cluster as an executor (executor.Executor), reached through its login node's agent as a host
    is: jobs submitted with sbatch, their state the scheduler's view laid over their run dir's (read as on a
    host), stopped with scancel."""

    schedules_gpus: ClassVar[bool] = True
    queues: ClassVar[bool] = True
    processes: ClassVar[bool] = False

    def __init__(self, host: Host, transport: Transport):
        super().__init__(transport)
        self.host = host

    def launch(self, paths: RunPaths, script: str, token: str, gpus: int | None = None, nodes: int = 1,
               facts: dict[str, Any] | None = None) -> JobRef:
        """sbatch the job through the login node's agent (idempotent for the same token): one job of `nodes`
        nodes, its script run once per node. With `facts`, the job looks at its node for the receipt when it
        starts (the run dir's `.orch/facts.json`: receipt.node_facts reads it)."""
        options = sbatch_args(self.host, paths, self.host.gpus if gpus is None else gpus, nodes)
        job = self.call("submit", timeout=180, dir=paths.root, script=node_script(script, nodes), token=token,
                        options=options, **({"facts": facts} if facts is not None else {}))
        return JobRef(int(job["job_id"]), job_name(paths), scheduled=True)

    def find(self, paths: RunPaths) -> JobRef | None:
        """The job a run dir was submitted as (for a run whose controller died while launching)."""
        job_id = self.call("find", dir=paths.root).get("job_id")
        return JobRef(job_id, job_name(paths), scheduled=True) if isinstance(job_id, int) else None

    def lookup(self, job: JobRef, hold_s: float = 0) -> JobInfo | None:
        """The job as the cluster's queue saw it this round (one squeue per round for every run), after
        waiting up to `hold_s` for it to change."""
        queue = queue_for(self.transport)
        info = queue.wait(str(job.id), hold_s) if hold_s > 0 else queue.lookup(str(job.id))
        if info is not None and info.name and job.proof and info.name != job.proof:
            return None  # the id was reused for another job (the cluster's state was reset): ours is long gone
        return info

    def poll(self, paths: RunPaths, job: JobRef, offset: int, max_bytes: int, hold_s: float = 0,
             wake: Sequence[str] = (), inode: int | None = None, mark: str | None = None) -> JobState:
        """The scheduler's view first (waiting up to hold_s for a change: the scheduler is asked once per
        round for all jobs, so the hold is spent here, not on a node), then the run dir's as the login
        node's agent reads it: a job seen ended has its last bytes in this same answer."""
        info = self.lookup(job, hold_s)
        state = super().poll(paths, job, offset, max_bytes, inode=inode, mark=mark)
        return self._laid_over(job, state, info)

    def judge(self, job: JobRef, state: JobState) -> JobState:
        """A state the login node's agent pushed, with the scheduler's view laid over it."""
        return self._laid_over(job, state, self.lookup(job))

    def _laid_over(self, job: JobRef, state: JobState, info: JobInfo | None) -> JobState:
        """The run dir's side of a job's state (its log, exit code, the node its batch script noted) with the
        scheduler's view laid over it: alive while Slurm has it, queued and why, the end Slurm decided."""
        started = state.node is not None  # the batch script ran: whatever a queue answer of this round still says
        state.alive = info is not None and not info.ended
        if info is None:
            if state.exit_code is None:
                state.cause = f"UNKNOWN: Slurm has no record of job {job.id}"
            return state
        state.node = state.node or info.node
        if info.queued and not started:
            state.queued = info.reason or "not yet scheduled"
        if state.exit_code not in (None, 0) and not info.ended:
            # A job Slurm stops (time limit, preemption, scancel) exits non-zero before Slurm records why:
            # the end waits for the scheduler's verdict, one round later.
            state.exit_code = None
        if info.ended:
            queue = queue_for(self.transport)
            if info.state in CAUSES:
                state.cause = f"{info.state}: Slurm job {info.job_id}: {CAUSES[info.state]}"
            elif state.exit_code is None and info.exit_code is not None:
                state.exit_code = info.exit_code  # the wrapper could not write it (the run dir was unreachable)
            elif state.exit_code is None:
                if queue.clock() - queue.ended_seen.get(info.job_id, queue.clock()) < EXIT_CODE_WAIT_S:
                    # a state read from the run dir before the scheduler's answer that the job ended: the
                    # exit code the wrapper wrote last comes with the next one
                    state.alive = True
                    return state
                state.cause = f"{info.state}: Slurm job {info.job_id} ended without the job's exit code"
            queue.forget(info.job_id)
        return state

    def kill(self, job: JobRef, grace_s: float) -> str:
        """scancel: Slurm signals every process of the job (SIGTERM, SIGKILL after its KillWait); SIGKILL
        from here when the job outlives the grace. 'gone' | 'stopped' | 'killed'."""
        info = self.lookup(job)
        if info is None or info.ended:
            return "gone"
        self.call("scancel", job_id=job.id)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            time.sleep(min(0.5, grace_s))
            if not self._active(job.id):
                return "stopped"
        self.call("scancel", job_id=job.id, kill=True)
        return "killed"

    def _active(self, job_id: int) -> bool:
        try:
            rows = self.call("squeue", job_id=job_id)["jobs"]
        except AgentError:  # squeue refuses an id it no longer knows
            return False
        return bool(rows) and _state(str(rows[0].get("state", ""))) not in ENDED

    def explain_loss(self, paths: RunPaths, job: JobRef) -> str | None:
        return None  # the scheduler's cause comes with the job's state


def ping(transport: Transport, timeout: float) -> str:
    """`orch hosts --check` on a cluster: the scheduler answers; its partitions and their node counts."""
    rows = agent.call(transport, "sinfo", timeout=timeout, what="partitions")["rows"]
    partitions = [row for row in rows if len(row) == 2]
    return "slurm: " + (", ".join(f"{name} ({nodes} nodes)" for name, nodes in partitions) or "no partitions")


def gpus_by_node(transport: Transport) -> list[dict[str, Any]]:
    """The cluster's GPUs per node from the scheduler: total, in use, node state."""
    rows: dict[str, dict[str, Any]] = {}
    for parts in agent.call(transport, "sinfo", what="nodes")["rows"]:
        if len(parts) < 4 or not parts[0]:
            continue
        node, gres, used, state = parts[:4]
        row = rows.setdefault(node, {"node": node, "gpus": _gpu_count(gres), "used": _gpu_count(used),
                                     "state": state, "partitions": []})
        if len(parts) > 4 and parts[4]:
            row["partitions"].append(parts[4].rstrip("*"))  # "*": the default partition
    return list(rows.values())


def _gpu_count(gres: str) -> int:
    """`gpu:8`, `gpu:h100:8(S:0-1)`, `gpu:2(IDX:0-1),shard:0` → the number of GPUs."""
    total = 0
    for item in gres.split(","):
        fields = item.split("(")[0].split(":")
        if fields[0] == "gpu" and fields[-1].isdigit():
            total += int(fields[-1])
    return total
