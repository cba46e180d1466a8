"""Jobs on a Slurm cluster: submitted with sbatch, watched through one batched queue query per round.

The cluster is reached through its login node's transport (SSH, or this machine when the host has no
address); run dirs live under the host's workdir on the filesystem the nodes share, so the job's log,
pid and exit code are read there exactly as on a host. The batch script is the host wrapper (pid and
start time on the node, combined log, exit code), so every playbook's job script runs unchanged.

A handle is (job id, "slurm:<job name>"): the name guards against a job id reused after the cluster's
state was reset. The scheduler owns the GPUs: a job asks for a count (`--gres=gpu:N`), Slurm sets
CUDA_VISIBLE_DEVICES and cleans up after the job, so orch neither cleans GPUs nor leases the host.

Every watcher of a cluster in this process shares one `Queue`: whatever the number of runs, a poll
round costs one `squeue` (plus one `sacct` for jobs that already left squeue's memory). The text
formats of squeue/sacct (`-o '%i|%T|...'`, `-P`) are used rather than `--json`, whose schema changes
between Slurm releases; lines that do not parse are skipped.
"""

from __future__ import annotations

import base64
import posixpath
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import launch
from .errors import OrchError, Unreachable
from .hosts import Host
from .launch import JobState, RunPaths
from .remote import Transport, quote

MARK = "slurm:"  # Run.job_id knows it too
POLL_MARK = "orch-slurm-poll"

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

# The host wrapper, as the batch script: it runs in the run dir on the job's first node, and notes that
# node (a job that ends between two queue queries is never seen running there).
BATCH = f"#!/bin/bash\nprintf '%s\\n' \"$SLURMD_NODENAME\" > {launch.CONTROL}/node\n" + launch.WRAPPER


def job_name(paths: RunPaths) -> str:
    return f"orch-{posixpath.basename(paths.root)}"


def sbatch_args(host: Host, paths: RunPaths, gpus: int) -> list[str]:
    """sbatch's options for a run: where it runs, what it asks for; every value becomes one quoted word."""
    args = [f"--job-name={job_name(paths)}", f"--chdir={paths.root}", f"--output={paths.root}/slurm.out",
            "--nodes=1", "--parsable"]
    if gpus:
        args.append(f"--gres=gpu:{int(gpus)}")
    for option, value in (("partition", host.partition), ("account", host.account), ("qos", host.qos),
                          ("time", host.time_limit), ("constraint", host.constraint)):
        if value:
            args.append(f"--{option}={value}")
    return args + list(host.sbatch_args)


def submit_command(paths: RunPaths, script: str, token: str, args: list[str], staged: str | None = None) -> str:
    """One call on the login node: write the scripts to the run dir, sbatch the wrapper, print the job id.

    Idempotent for the same token (a retry prints the job id submitted before); a failed sbatch leaves
    no token behind, so the launch can be tried again.
    """
    root, C = quote(paths.root), launch.CONTROL
    batch_b64 = base64.b64encode(BATCH.encode()).decode()
    drop = f"rm -f {quote(staged)}; " if staged is not None else ""  # an upload that is not needed after all
    return (
        f"mkdir -p {root} && cd {root} || exit 96\n"
        f"if [ -e {C}/token ] || [ -e token ]; then [ \"$(cat {C}/token 2>/dev/null)\" = {quote(token)} ] "
        f"|| {{ {drop}echo \"run dir in use by another run: $(pwd)\" >&2; exit 94; }}\n"
        f"  [ -s {C}/job_id ] && {{ {drop}cat {C}/job_id; exit 0; }}\n"
        f"else mkdir -p {C} && printf '%s' {quote(token)} > {C}/token; fi\n"
        + launch.write_script(script, staged)
        + f"printf %s {batch_b64} | base64 -d > {C}/batch.sh\n"
        f"sbatch {' '.join(quote(a) for a in args)} {C}/batch.sh > {C}/job_id.tmp || "
        f"{{ rm -f {C}/token {C}/job_id.tmp; exit 95; }}\n"
        f"mv {C}/job_id.tmp {C}/job_id && cat {C}/job_id\n"
    )


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


# `%r` last: a reason is the one field that may hold the separator.
SQUEUE_FORMAT = "%i|%T|%N|%j|%r"


def parse_squeue(text: str) -> dict[str, JobInfo]:
    jobs: dict[str, JobInfo] = {}
    for line in text.splitlines():
        parts = line.split("|", 4)
        if len(parts) != 5 or not parts[0].strip():
            continue
        job_id, state, node, name, reason = parts
        jobs[job_id.strip()] = JobInfo(job_id.strip(), _state(state), _blank(node), name.strip() or None,
                                       _blank(reason))
    return jobs


SACCT_FIELDS = "JobIDRaw,State,NodeList,JobName,ExitCode"


def parse_sacct(text: str) -> dict[str, JobInfo]:
    """`sacct -P -n -X -o JobIDRaw,State,NodeList,JobName,ExitCode`; ExitCode is `code:signal`."""
    jobs: dict[str, JobInfo] = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 5 or not parts[0].strip().isdigit():
            continue
        job_id, state, node, name, exit_code = (p.strip() for p in parts[:5])
        code, _, signal = exit_code.partition(":")
        value = int(code) if code.isdigit() else None
        if value == 0 and signal.isdigit() and int(signal):
            value = 128 + int(signal)
        jobs[job_id] = JobInfo(job_id, _state(state), _blank(node), name or None, None, value)
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
            started = self.clock()
            jobs = self._ask()
        finally:
            with self.cond:
                self.asking = False
                self.cond.notify_all()
        with self.cond:
            self.jobs, self.asked_at = jobs, started
            self.ended.update({k: v for k, v in jobs.items() if v.ended and k in self.watched})
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
        res = self.transport.run(f"squeue -h -t all -u \"$(id -un)\" -o {quote(SQUEUE_FORMAT)}", check=False,
                                 timeout=60)
        if not res.ok:
            # a controller restarting or overloaded: the watcher tries again later, as for a host offline
            raise Unreachable(self.transport.host.name,
                              f"squeue failed: {(res.stderr or res.stdout).strip()[-300:]}")
        jobs = parse_squeue(res.stdout)
        gone = sorted(k for k in self.watched if k not in jobs and k not in self.ended)
        if gone:
            jobs.update(self._accounting(gone))
        return jobs

    def _accounting(self, ids: list[str]) -> dict[str, JobInfo]:
        """sacct from the accounting database, else (no slurmdbd) from the job-completion file."""
        self.calls += 1
        listed = quote(",".join(ids))
        res = self.transport.run(
            f"sacct -n -P -X -j {listed} -o {SACCT_FIELDS} 2>/dev/null || "
            f"sacct -c -n -P -j {listed} -o {SACCT_FIELDS} 2>/dev/null || true", check=False, timeout=60)
        return parse_sacct(res.stdout)


_queues: dict[str, Queue] = {}
_queues_lock = threading.Lock()


def query_interval(host: Host) -> float:
    """The shortest gap between two queries of a cluster's queue: a third of its shortest poll, 1 s to 10 s
    (a cluster polled from 30 s sees a job's end by the scheduler within 10 s)."""
    return min(max(host.default_poll[0] / 3, 1.0), 10.0)


def queue_for(transport: Transport) -> Queue:
    """The one queue of a cluster in this process."""
    with _queues_lock:
        q = _queues.get(transport.host.name)
        if q is None or q.transport.host != transport.host:
            q = _queues[transport.host.name] = Queue(transport, query_interval(transport.host))
        return q


def files_command(paths: RunPaths, offset: int, max_bytes: int) -> str:
    """The run dir's side of a poll: exit code, log size and the log's new bytes (as launch.poll_command)."""
    return (
        f"d={quote(paths.root)}; [ -d \"$d\" ] && present=1 || present=0\n"
        + launch.CONTROL_OF_D
        + 'ec=$(head -c 20 "$c/exit_code" 2>/dev/null | tr -cd 0-9-); [ -n "$ec" ] || ec=none\n'
        'node=$(head -c 200 "$c/node" 2>/dev/null | tr -cd "A-Za-z0-9_.-"); [ -n "$node" ] || node=-\n'
        'size=$(stat -c %s "$d/log" 2>/dev/null || echo 0)\n'
        f"off={int(offset)}; [ \"$size\" -lt \"$off\" ] && off=0\n"
        'began=$(head -c 40 "$c/started_at" 2>/dev/null | tr -cd 0-9.)\n'
        'ended=$(head -c 40 "$c/ended_at" 2>/dev/null | tr -cd 0-9.)\n'
        f'echo "{POLL_MARK} $ec $size $off $present $node ${{began:-none}} ${{ended:-none}}"\n'
        f'tail -c +$((off + 1)) "$d/log" 2>/dev/null | head -c {int(max_bytes)} | base64 -w0\n'
    )


Handle = tuple[int, str]


def submit(transport: Transport, host: Host, paths: RunPaths, script: str, token: str, gpus: int) -> Handle:
    staged = launch.stage_script(transport, paths, script, token)
    out = transport.run(submit_command(paths, script, token, sbatch_args(host, paths, gpus), staged),
                        timeout=120).stdout
    return parse_job_id(out), MARK + job_name(paths)


def find(transport: Transport, paths: RunPaths) -> Handle | None:
    """The job a run dir was submitted as (for a run whose controller died while launching)."""
    out = transport.run(f"cat {quote(paths.control)}/job_id 2>/dev/null || cat {quote(paths.root)}/job_id 2>/dev/null"
                        " || true", timeout=60).stdout
    try:
        return parse_job_id(out), MARK + job_name(paths)
    except OrchError:
        return None


def _info(transport: Transport, handle: Handle, hold_s: float = 0) -> JobInfo | None:
    queue = queue_for(transport)
    info = queue.wait(str(handle[0]), hold_s) if hold_s > 0 else queue.lookup(str(handle[0]))
    if info is not None and info.name and handle[1].startswith(MARK) and info.name != handle[1][len(MARK):]:
        return None  # the id was reused for another job (the cluster's state was reset): ours is long gone
    return info


def read_state(transport: Transport, paths: RunPaths, handle: Handle, offset: int, max_bytes: int,
               hold_s: float = 0) -> JobState:
    """The scheduler's view first (waiting up to hold_s for a change), then the run dir's: a job seen
    ended has its last bytes in this same answer."""
    info = _info(transport, handle, hold_s)
    out = transport.run(files_command(paths, offset, max_bytes), timeout=120).stdout
    head, _, body = out.partition("\n")
    fields = head.split()
    if len(fields) != 8 or fields[0] != POLL_MARK:
        raise OrchError(f"{transport.host.name}: unexpected answer while polling: {head[:200]!r}")
    _, ec, size, off, present, node, began, ended = fields
    exit_code = int(ec) if ec.lstrip("-").isdigit() else None
    state = JobState(True, exit_code, int(size), int(off), base64.b64decode(body.strip() or b""),
                     run_dir=present == "1", started_at=_epoch(began), ended_at=_epoch(ended))
    state.node = node if node != "-" else None
    return judge(transport, handle, state, info)


def _epoch(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def judge(transport: Transport, handle: Handle, state: JobState, info: JobInfo | None) -> JobState:
    """The run dir's side of a job's state (its log, exit code, the node its batch script noted) with the
    scheduler's view laid over it: alive while Slurm has it, queued and why, the end Slurm decided."""
    started = state.node is not None  # the batch script ran: whatever a queue answer of this round still says
    state.alive = info is not None and not info.ended
    if info is None:
        if state.exit_code is None:
            state.cause = f"UNKNOWN: Slurm has no record of job {handle[0]}"
        return state
    state.node = state.node or info.node
    if info.queued and not started:
        state.queued = info.reason or "not yet scheduled"
    if state.exit_code not in (None, 0) and not info.ended:
        # A job Slurm stops (time limit, preemption, scancel) exits non-zero before Slurm records why:
        # the end waits for the scheduler's verdict, one round later.
        state.exit_code = None
    if info.ended:
        queue_for(transport).forget(info.job_id)
        if info.state in CAUSES:
            state.cause = f"{info.state}: Slurm job {info.job_id}: {CAUSES[info.state]}"
        elif state.exit_code is None and info.exit_code is not None:
            state.exit_code = info.exit_code  # the wrapper could not write it (the run dir was unreachable)
        elif state.exit_code is None:
            state.cause = f"{info.state}: Slurm job {info.job_id} ended without the job's exit code"
    return state


def lookup(transport: Transport, handle: Handle) -> JobInfo | None:
    """The job as the cluster's queue saw it this round (one squeue per round for every run)."""
    return _info(transport, handle)


def cancel(transport: Transport, handle: Handle, grace_s: float) -> str:
    """scancel: Slurm signals every process of the job (SIGTERM, SIGKILL after its KillWait); SIGKILL
    from here when the job outlives the grace."""
    info = _info(transport, handle)
    if info is None or info.ended:
        return "gone"
    job = quote(str(handle[0]))
    transport.run(f"scancel {job}", timeout=60)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        time.sleep(min(0.5, grace_s))
        if not _active(transport, job):
            return "stopped"
    transport.run(f"scancel --signal=KILL --full {job}", timeout=60)
    return "killed"


def _active(transport: Transport, job: str) -> bool:
    out = transport.run(f"squeue -h -t all -j {job} -o %T 2>/dev/null || true", timeout=60).stdout
    return bool(out.strip()) and _state(out) not in ENDED


def ping(transport: Transport, timeout: float) -> str:
    """`orch hosts --check` on a cluster: the scheduler answers; its partitions and their node counts."""
    out = transport.run("sinfo -h -o '%P %D'", timeout=timeout).stdout
    partitions = [line.split() for line in out.splitlines() if len(line.split()) == 2]
    return "slurm: " + (", ".join(f"{name} ({nodes} nodes)" for name, nodes in partitions) or "no partitions")


def gpus_by_node(transport: Transport) -> list[dict[str, Any]]:
    """The cluster's GPUs per node from the scheduler: total, in use, node state."""
    out = transport.run("sinfo -h -N -O 'NodeList:|,Gres:|,GresUsed:|,StateLong:|,Partition:'", timeout=60).stdout
    rows: dict[str, dict[str, Any]] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
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
