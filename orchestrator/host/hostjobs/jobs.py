"""A job's start: the run dir claimed, its script written, and its wrapper (this package's `wrap` mode)
started as the leader of a session of its own."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

from .boot import BOOTSTRAP, SOURCES_RUN, archive
from .common import CONTROL, FACTS, FACTS_ASKED, JOB_MARK, RUN_MARK, _node, run_mark, write_whole
from .gpus import host_facts
from .procs import start_time
from .rundirs import _adoptable, _pid_at, claim_run_dir, open_run


def launch(root, script, token):
    """Create the run dir, write the job script, start the wrapper (this program's `wrap` mode) as a
    session leader; its pid and start.

    Idempotent for the same token (a retry never starts the job twice); a run dir holding another
    run's token, or a symlink for its token, is refused, never reused. The run dir is opened once and
    the wrapper starts in the folder held, whatever is renamed meanwhile.
    """
    with claim_run_dir(root, token) as run:
        started = _adoptable(run, token)  # claimed before its patches, or a retried launch
        if started is not None:
            return {**started, "again": True}
        write_whole("job.sh", script, 0o600, dir_fd=run.fd)  # its environment may hold secrets: the owner's only
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            # the same checked bytes as this agent, never the file as it may be now; it detaches (forks
            # into a session of its own, no longer this agent's child), so the job outlives this agent and
            # its channel, as under setsid nohup. Its own environment names the run: proof, should the
            # launch be retried, that the pid file names this run's wrapper.
            starter = subprocess.Popen(self_command("wrap", "--detach"), cwd=run.cwd, stdin=devnull,
                                       stdout=devnull, stderr=devnull, start_new_session=True, close_fds=True,
                                       env={**os.environ, RUN_MARK: run_mark(token)})
        finally:
            os.close(devnull)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            job = _pid_at(run)
            if job is not None:
                starter.wait()
                return {**job, "again": False}
            if starter.poll() not in (None, 0):
                raise RuntimeError(f"the wrapper exited with {starter.returncode} before it wrote its pid")
            time.sleep(0.02)
        raise RuntimeError("the wrapper wrote no pid within 10 s")

def own_digest():
    """The sha256 of the archive running now (the bootstrap's checked one), else of these sources as one."""
    given = globals().get("ORCH_ARCHIVE")
    if given:
        return given[1]
    return hashlib.sha256(archive()).hexdigest()


def self_command(*args):
    """This package's own mode (the job wrapper), isolated (-I): it starts in the run dir, and nothing there,
    in PYTHON* variables or in the user's site folder decides what it imports. From the archive, the same
    checked bytes again (the bootstrap checks them again); from these sources, the package as it is here."""
    given = globals().get("ORCH_ARCHIVE")
    if given:
        return [sys.executable, "-I", "-c", BOOTSTRAP, given[0], given[1], *args]
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    return [sys.executable, "-I", "-c", SOURCES_RUN, top, *args]


def wrap(detach, root=None, mark=None):
    """The wrapper of a job, in its run dir, as the leader of its session: it records its pid with its
    start time, the job's combined output in `log` (opened for appending, so a log truncated under the
    job gets no hole of zeros), and the job's start, end and exit code in the control folder (the end
    time first, so a run seen ended has both). `ORCH_JOB=PID:START` marks everything the job starts.
    With `detach` it first forks away from its starter (the agent), in a session of its own; a batch
    job's wrapper stays the batch script's process, as its scheduler ends the job when that one exits.
    """
    if detach:
        if os.fork() > 0:
            os._exit(0)
        os.setsid()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nohup: the job inherits it
    if root is not None:  # a batch job, started long after its submission: the run dir checked again
        enter_run(root, mark)
    node = _node(os.environ.get("SLURMD_NODENAME"))
    if node:  # a batch job notes its node: one that ends between two queue queries is never seen running
        write_whole(os.path.join(CONTROL, "node"), node + "\n", 0o644)
    if root is not None:
        node_facts(node)
    write_whole(os.path.join(CONTROL, "started_at"), f"{time.time():.9f}\n", 0o644)
    pid = os.getpid()
    start = start_time(pid)
    os.environ[JOB_MARK] = f"{pid}:{start}"
    write_whole(os.path.join(CONTROL, "pid"), f"{pid} {start}\n", 0o644)
    log = os.open("log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    with open(os.devnull, "rb") as devnull:
        code = subprocess.call(["bash", "./job.sh"], stdin=devnull, stdout=log, stderr=log)
    os.close(log)
    code = code if code >= 0 else 128 - code  # killed by a signal: as a shell says it
    write_whole(os.path.join(CONTROL, "ended_at"), f"{time.time():.9f}\n", 0o644)
    write_whole(os.path.join(CONTROL, "exit_code"), f"{code}\n", 0o644)
    return code


def node_facts(node):
    """A batch job's receipt facts, looked at on its node before it starts, when its submission asked."""
    try:
        with open(os.path.join(CONTROL, FACTS_ASKED)) as f:
            asked = json.load(f)
        write_whole(os.path.join(CONTROL, FACTS), json.dumps({**host_facts(asked), "node": node}), 0o600)
    except (OSError, ValueError):  # none asked, or unreadable: the job runs all the same
        pass


def enter_run(root, mark):
    """Work in the run dir at `root` only when it is still this run's: reached through this user's folders,
    none a link, holding the token whose mark is `mark`; exits (97, saying why) otherwise."""
    try:
        run = open_run(root)
        if run is None or run.control is None or run_mark(run.read("token") or "") != mark:
            raise RuntimeError(f"the run dir {root} is gone or is not this run's")
        os.fchdir(run.fd)
        run.close()
    except (RuntimeError, OSError) as exc:
        sys.stderr.write(f"orch: refusing to start the job: {exc}\n")
        sys.exit(97)


