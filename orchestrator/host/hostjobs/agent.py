"""orch's agent on a host: one stdlib-only Python program per watcher connection, speaking JSON lines.

orch places this file in the host's workdir under its content hash and starts it over one SSH channel
(or as a child process on this machine). Requests come on stdin, one JSON object a line:
`{"id": N, "op": NAME, ...}`; each gets one reply `{"id": N, "ok": true, "result": {...}}` or
`{"id": N, "ok": false, "error": TEXT}`. Without being asked, the agent pushes what happens, as it
happens: `{"push": "state", "key": K, ...}` for a followed run whose log grew (bytes batched over one
tick), whose job ended or whose liveness changed, and `{"push": "beat"}` every BEAT_S, so the other end
tells a quiet host from a dark link.

A message that carries file bytes (a state's log bytes, a chunk) says how many in `"bytes": N`, and
those N bytes follow its line raw: no base64 to encode here or to decode there, a third less to carry.
A backlog goes out chunk after chunk without waiting for the tick, within a window: at most WINDOW
pushed bytes the watcher has not acknowledged (`ack`) yet, so a watcher slower than the disk holds a
bounded amount in memory, and never has to stop reading its channel (where its replies come too).

Nothing here is run through a shell, and nothing read from a file on the host is evaluated: a job is
known by its wrapper's pid and start time (field 22 of /proc/PID/stat), proved again before every
signal. It exits when its stdin closes or stays silent for IDLE_EXIT_S (the watcher is gone).

Runs on the host's python (3.8 or newer): no annotations evaluated, no third-party imports.
"""

import errno
import hashlib
import json
import os
import pwd
import re
import selectors
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

TICK_S = 0.05  # how often followed logs and jobs are looked at; a push batches the bytes of one tick
BEAT_S = 2.0
IDLE_EXIT_S = 60.0  # the watcher pings every few seconds; this long without a word, it is gone
CHUNK = 1 << 20  # log bytes per push; a backlog goes out as consecutive pushes
WINDOW = 8 << 20  # pushed log bytes not yet acknowledged by the watcher, at most
HOLD_STEP_S = 0.2  # how often a held read looks for news
GROUP_CHECK_S = 0.5  # a wrapper-less group is looked for in /proc at most this often
CONTROL = ".orch"
FACTS_ASKED, FACTS = "facts_asked.json", "facts.json"  # a batch job's receipt facts: asked at submission, seen on its node
JOB_MARK = "ORCH_JOB"
TAIL_MARK = 64  # bytes before an offset compared, to tell a log rewritten under it
DISK_FULL_KIB = 64
TAIL_BYTES = 1 << 20  # the last lines of a file come from its last MiB

_out_lock = threading.Lock()


def send(doc):
    """One message: its JSON line, then the raw bytes of its `data` (a push's, or its result's)."""
    box = doc.get("result") if isinstance(doc.get("result"), dict) else doc
    data = box.pop("data", None)
    if isinstance(data, bytes):
        doc["bytes"] = len(data)
    elif data is not None:
        box["data"] = data
    head = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    with _out_lock:
        _write_all(head)
        if data:
            _write_all(data)


def _write_all(data):
    view = memoryview(data)
    while view:
        n = os.write(1, view)
        view = view[n:]


# -- processes ------------------------------------------------------------------------------------
def _stat_fields(pid):
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def start_time(pid):
    """The process start time in clock ticks (field 22), or None when there is no such process."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def live_start(pid):
    """Like start_time, None for a zombie too (where nothing reaps orphans a dead wrapper lingers)."""
    fields = _stat_fields(pid)
    return fields[19] if fields and fields[0] != "Z" else None


def group_pids(pgid):
    """The live (non-zombie) members of a process group."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(name)
        if fields and fields[0] != "Z" and fields[2] == str(pgid):
            found.append(int(name))
    return found


def _marked(pid, mark):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:
        return False


def _job_member(m, pid, start):
    """Whether process m is the job's though its wrapper is gone: live, in the job's group, started after
    the wrapper, carrying the wrapper's mark."""
    fields = _stat_fields(m)
    return (fields is not None and fields[0] != "Z" and fields[2] == str(pid) and int(fields[19]) >= int(start)
            and _marked(m, f"{JOB_MARK}={int(pid)}:{start}".encode()))


def ours(pid, start):
    """What of the job's process group is provably the job's now: "group" while its leader (the wrapper,
    a zombie included) has the job's start time and the group has live members; with no process at the
    pid (the wrapper died, its group runs on), the members started after it that carry its mark; None
    when the pid is another process now, or nothing is left."""
    if not str(start).isdigit():
        return None
    now = start_time(pid)
    if now == str(start):
        return "group" if group_pids(pid) else None
    if now is not None:
        return None
    return [m for m in group_pids(pid) if _job_member(m, pid, start)] or None


PIDFD_SIGNAL_PROCESS_GROUP = 4  # linux/pidfd.h (Linux 6.9): signal the held process's whole group
# Python 3.8 has no os.pidfd_open: the system calls themselves, numbered alike on every Linux architecture
SYS_PIDFD_SEND_SIGNAL, SYS_PIDFD_OPEN = 424, 434


def _syscall(number, *args):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    res = libc.syscall(number, *[ctypes.c_long(a) for a in args])
    if res < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))  # ESRCH comes out a ProcessLookupError
    return res


def _pidfd_send(fd, sig, flags=0):
    if hasattr(signal, "pidfd_send_signal"):
        signal.pidfd_send_signal(fd, sig, None, flags)
    else:
        _syscall(SYS_PIDFD_SEND_SIGNAL, fd, sig, 0, flags)


def _hold(pid):
    """A pidfd on this very process (Linux 5.3), taken before the process is proved ours: a signal sent
    through it reaches that process or nothing, never a later one that took its pid after the proof. None
    where the host has no pidfds (there the proof and the signal by number follow each other as closely as
    they can); raises ProcessLookupError when the process is gone."""
    try:
        return os.pidfd_open(pid) if hasattr(os, "pidfd_open") else _syscall(SYS_PIDFD_OPEN, pid, 0)
    except ProcessLookupError:
        raise
    except (OSError, ImportError, AttributeError):  # ENOSYS, a sandbox's EPERM, a Python built without ctypes
        return None


def _signal_proved(pid, sig, proof, group=False):
    """Hold the process, prove it (`proof()` reads /proc afresh), signal it (or, with `group`, its
    process group) through the hold. True when signalled."""
    try:
        fd = _hold(pid)
    except ProcessLookupError:
        return False
    try:
        if not proof():
            return False
        if fd is None:
            (os.killpg if group else os.kill)(pid, sig)
        elif not group:
            _pidfd_send(fd, sig)
        else:
            try:
                _pidfd_send(fd, sig, PIDFD_SIGNAL_PROCESS_GROUP)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                return _signal_members(fd, pid, sig)  # before Linux 6.9
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def _signal_each(sig, proofs):
    """Signal every (pid, proof) on its own, not only up to the first that is; True when any was."""
    sent = False
    for pid, proof in proofs:
        sent = _signal_proved(pid, sig, proof) or sent
    return sent


def _signal_members(leader, pgid, sig):
    """Each member of the held leader's group on its own: held, then proved in the group while the
    leader still exists (until it is reaped, no other group can have its pid for an id)."""
    def in_group(m):
        fields = _stat_fields(m)
        if fields is None or fields[2] != str(pgid):
            return False
        _pidfd_send(leader, 0)  # raises ProcessLookupError once the leader is reaped
        return True

    return _signal_each(sig, [(m, lambda m=m: in_group(m)) for m in group_pids(pgid)])


def signal_job(pid, start, sig):
    """Signal what is provably the job's; False when nothing is. Each process is held before its proof
    and signalled through the hold, so a pid freed and given to another process meanwhile (in the
    grace window, say) is never reached. A process of the job that left its group (`setsid`) is the
    job's by its mark, and signalled too."""
    if not str(start).isdigit():
        return False
    pid = int(pid)
    strays = _signal_each(sig, [(m, lambda m=m: _stray(m, pid, start)) for m in strays_of(pid, start)])
    if _signal_proved(pid, sig, lambda: ours(pid, start) == "group", group=True):
        return True
    who = ours(pid, start)  # the wrapper gone: its marked members, each proved again once held
    members = who if isinstance(who, list) else []
    return _signal_each(sig, [(m, lambda m=m: _job_member(m, pid, start)) for m in members]) or strays


def _stray(m, pid, start):
    """Whether process m is the job's outside its group: this user's, live, started after the wrapper,
    carrying its mark (a child that left the group with `setsid`)."""
    fields = _stat_fields(m)
    try:
        mine = os.stat(f"/proc/{m}").st_uid == os.geteuid()
    except OSError:
        return False
    return (mine and fields is not None and fields[0] != "Z" and fields[2] != str(pid)
            and int(fields[19]) >= int(start) and _marked(m, f"{JOB_MARK}={int(pid)}:{start}".encode()))


def strays_of(pid, start):
    """The job's processes outside its group (see _stray)."""
    return [int(n) for n in os.listdir("/proc") if n.isdigit() and _stray(int(n), pid, start)]


def terminate(send, alive, grace_s):
    """Every stop here: SIGTERM, a grace period, SIGKILL: 'gone' | 'stopped' | 'killed'. `send(sig)` signals
    what is still provably the target (False: nothing is); `alive()` says whether anything of it is left."""
    if not send(signal.SIGTERM):
        return "gone"
    deadline = time.monotonic() + max(0.0, float(grace_s))
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if not alive():
            return "stopped"
    return "killed" if send(signal.SIGKILL) else "stopped"


def kill(pid, start, grace_s):
    """Stop the job's process group, proved the job's before each signal."""
    return terminate(lambda sig: signal_job(pid, start, sig),
                     lambda: ours(pid, start) is not None or bool(strays_of(pid, start)), grace_s)


def stacks(pid, start):
    """py-spy's stacks of every live process of the job's group (only those proven the job's when its
    start time is known): read-only, a stalled job's picture."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "py-spy is not installed on this host"
    who = ours(pid, start) if start else "group"
    members = group_pids(pid) if who == "group" else (who or [])
    parts = []
    for m in sorted(members):
        try:
            out = subprocess.run([spy, "dump", "--pid", str(m)], capture_output=True, timeout=60, check=False)
            said = (out.stdout + out.stderr).decode(errors="replace")
        except (OSError, subprocess.SubprocessError) as exc:
            said = f"{type(exc).__name__}: {exc}\n"
        parts.append(f"== pid {m}\n{said}")
    return "".join(parts)


# -- GPUs -----------------------------------------------------------------------------------------------
GPU_FIELDS = ("index", "uuid", "memory.used", "memory.total", "utilization.gpu")
APP_FIELDS = ("pid", "gpu_uuid", "used_memory")


def _csv(argv, fields, timeout):
    """Rows of an nvidia-smi query (csv, noheader, nounits) as dicts of their cells; raises with its words."""
    out = subprocess.run(argv + ["--format=csv,noheader,nounits"], capture_output=True, timeout=timeout, check=False)
    text = (out.stdout + out.stderr).decode(errors="replace")
    if out.returncode != 0:
        raise GpuError(" ".join(text.split())[:300] or f"exit code {out.returncode}")
    rows = []
    for line in out.stdout.decode(errors="replace").splitlines():
        cells = [c.strip() for c in line.split(", ")]
        if line.strip() and len(cells) == len(fields):
            rows.append(dict(zip(fields, cells)))
    return rows


class GpuError(Exception):
    pass


def process_info(pid):
    """What the host says of a process holding a GPU: its group, user, command line, start time, its group
    leader's start time and the run mark in its environment (readable only for one's own processes)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    pgid = int(fields[2])
    try:
        user = pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    except (OSError, KeyError):
        user = None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        command = ""
    mark = None
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(JOB_MARK.encode() + b"="):
                    mark = item.split(b"=", 1)[1].decode(errors="replace")
                    break
    except OSError:
        pass
    return {"pgid": pgid, "user": user, "command": command, "start": fields[19],
            "group_start": start_time(pgid), "mark": mark}


def gpus(timeout, facts=False):
    """The GPUs, their compute processes and what each process is, in one look; None without nvidia-smi.
    With `facts`, the same query asks for a receipt's GPU facts too (a driver that lacks one: without them)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    fields = GPU_FIELDS + tuple(f for f in GPU_FACTS if f not in GPU_FIELDS) if facts else GPU_FIELDS
    extra = {}
    try:
        gpu_rows = _csv([smi, "--query-gpu=" + ",".join(fields)], fields, timeout)
    except GpuError as exc:
        if fields == GPU_FIELDS:
            raise
        extra["facts_error"] = str(exc)[:300]
        gpu_rows = _csv([smi, "--query-gpu=" + ",".join(GPU_FIELDS)], GPU_FIELDS, timeout)
    apps = _csv([smi, "--query-compute-apps=" + ",".join(APP_FIELDS)], APP_FIELDS, timeout)
    procs = {}
    for app in apps:
        pid = app["pid"]
        if pid.isdigit() and pid not in procs:
            procs[pid] = process_info(int(pid))
    return {"gpus": gpu_rows, "apps": apps, "procs": procs, **extra}



# -- what a run's numbers were made on (its receipt), looked at in the launch request ----------------------
GPU_FACTS = ("index", "uuid", "name", "driver_version", "clocks.applications.graphics", "clocks.applications.memory",
             "clocks.max.sm", "ecc.mode.current", "ecc.errors.uncorrected.volatile.total",
             "clocks_throttle_reasons.active", "persistence_mode")
# run by the engine's python: the versions of the engine's distributions, from their metadata (no import)
VERSIONS = ("import importlib.metadata as m, json, sys\n"
            "def v(n):\n    try:\n        return m.version(n)\n    except Exception:\n        return None\n"
            "print(json.dumps({'python': sys.version.split()[0], 'packages': {n: v(n) for n in sys.argv[1:]}}))")
FACT_FILE_MAX = 64 << 20  # a model's config files are small: anything larger is named, not hashed


def file_sha256(path):
    """The sha256 of a plain file (None: absent, not a plain file, or too large to be a config)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > FACT_FILE_MAX:
            return None
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    except OSError:
        return None


def cpu_facts():
    model = None
    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            for row in f:
                if row.startswith("model name"):
                    model = row.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"model": model, "count": os.cpu_count()}


def host_facts(request, timeout=30):
    """What a run's numbers are made on: the engine's versions (from its python), the sha256 of the model's
    config files, the GPUs (model, driver, clocks, ECC and throttle state) or, without nvidia-smi, the CPU;
    each part that cannot be read says why instead."""
    found = {"hostname": socket.gethostname(), "cpu": cpu_facts()}
    python, packages = request.get("python"), request.get("packages") or []
    if python:
        out = run_argv([python, "-c", VERSIONS, *packages], timeout, 1 << 16)
        try:
            found["engine"] = json.loads(out["stdout"].strip().splitlines()[-1])
        except (ValueError, IndexError):
            found["engine"] = {"error": " ".join((out["stderr"] or "no output").split())[-300:]}
    found["files"] = {path: file_sha256(path) for path in request.get("files") or []}
    smi = shutil.which("nvidia-smi") if request.get("gpus", True) else None  # False: the GPU check saw them
    if smi is not None:
        try:
            found["gpus"] = _csv([smi, "--query-gpu=" + ",".join(GPU_FACTS)], GPU_FACTS, timeout)
            found["gpu_apps"] = _csv([smi, "--query-compute-apps=" + ",".join(APP_FIELDS)], APP_FIELDS, timeout)
        except (GpuError, OSError, subprocess.SubprocessError) as exc:
            found["gpu_error"] = str(exc)[:300]
    return found


def kill_pids(procs, grace_s):
    """Stop each process that still has the start time seen. Each process is held before its start time is
    checked, and signalled through the hold: a reused pid is left alone."""
    def signal_all(sig):
        return _signal_each(sig, [(pid, lambda pid=pid, start=start: live_start(pid) == start)
                                  for pid, start in procs])

    return terminate(signal_all, lambda: any(live_start(pid) == start for pid, start in procs), grace_s)


# -- Slurm, on its login node -------------------------------------------------------------------------------
# squeue's `%r` comes last: a reason is the one field that may hold the separator.
SQUEUE_FIELDS = ("job_id", "state", "node", "name", "reason")
SACCT_FIELDS = ("JobIDRaw", "State", "NodeList", "JobName", "ExitCode")
SINFO_FORMATS = {"partitions": ["-o", "%P %D"],
                 "nodes": ["-N", "-O", "NodeList:|,Gres:|,GresUsed:|,StateLong:|,Partition:"]}


def _scheduler(argv, timeout=60, cwd=None):
    """Run one of the scheduler's commands (an argv, no shell); its output, or raises with its words."""
    out = subprocess.run(argv, capture_output=True, timeout=timeout, check=False, cwd=cwd)
    if out.returncode != 0:
        said = (out.stderr or out.stdout).decode(errors="replace").strip()
        raise RuntimeError(f"{argv[0]} failed: {said[-300:] or f'exit code {out.returncode}'}")
    return out.stdout.decode(errors="replace")


# -- a run dir, opened once ------------------------------------------------------------------------------
# A shared workdir's group can write in `<workdir>/runs/`: a run dir is reached only through folders this
# user owns (`runs/` itself this user's, root's, or sticky), each opened without following a link, and
# everything after is done relative to the descriptors held, so a folder renamed or swapped meanwhile is
# never used.
RUN_MARK = "ORCH_RUN"  # in the wrapper's own environment: which run's wrapper it is (a digest of its token)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def run_mark(token):
    return hashlib.sha256(token.encode()).hexdigest()[:32]


class RunDir:
    """A run dir's folder and its control folder, held open (`fd`, `control`; `control` None when absent)."""

    def __init__(self, fd, control):
        self.fd, self.control = fd, control

    def close(self):
        for fd in (self.fd, self.control):
            if fd is not None:
                os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def cwd(self):
        """A path to the held folder, whatever its name is now (for a child's working directory)."""
        return f"/proc/self/fd/{self.fd}"

    def read(self, name, limit=4096):
        """A small control file's text (None when absent, a link, not a plain file, or not this user's)."""
        return _read_at(self.control if self.control is not None else self.fd, name, limit)

    def write(self, name, text, mode):
        _write_at(self.control, name, text, mode)


def _split_runs(root):
    """(the folder the checks start from, the names below it): the workdir's `runs` for
    `<workdir>/runs/.../<run>`, else the run dir's parent."""
    parts = root.rstrip("/").split("/")
    if len(parts) < 3 or any(p in ("", ".", "..") for p in parts[1:]):
        raise RuntimeError(f"not a plain absolute path for a run dir: {root}")
    runs = max([i for i in range(1, len(parts) - 1) if parts[i] == "runs"], default=len(parts) - 2)
    return "/".join(parts[:runs + 1]), parts[runs + 1:]


def _open_dir(parent, name, create, what):
    """`name` in the folder `parent` (a descriptor), never through a link; made (0755) when `create`."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
    try:
        os.mkdir(name, 0o755, dir_fd=parent)
    except FileExistsError:
        pass  # made meanwhile: opened and checked like any other
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise RuntimeError(f"refusing a {what} that is a symlink or not a folder: {name}") from None
        raise


def _own_dir(fd, path, anchor=False):
    """Refuse a folder this user does not own (the `anchor`, the workdir's runs/: also root's, or another
    user's that is sticky). Nobody else may rename or replace what is in it: the anchor, when others may
    write in it, must be sticky (made so when it is this user's); a folder below it is this user's alone
    (write for its owner only)."""
    st = os.fstat(fd)
    me, mode = os.geteuid(), stat.S_IMODE(st.st_mode)
    sticky = mode & stat.S_ISVTX
    if st.st_uid != me and not (anchor and (st.st_uid == 0 or sticky)):
        raise RuntimeError(f"refusing {path}: it belongs to uid {st.st_uid}, not to this user"
                           + (" (a shared runs/ must be sticky: its owner can `chmod +t` it)" if anchor else ""))
    if mode & 0o022 and not (anchor and sticky):
        if st.st_uid != me:
            raise RuntimeError(f"refusing {path}: others may write in it and it is not sticky")
        os.fchmod(fd, mode | stat.S_ISVTX if anchor else mode & ~0o022)


def open_run(root, create=False):
    """The run dir at `root` (and its control folder), reached from the workdir's `runs/` through folders
    of this user's only, none a link; made when `create`. None when it does not exist (and not `create`)."""
    runs, below = _split_runs(root)
    if create:
        os.makedirs(os.path.dirname(runs), exist_ok=True)  # the workdir, as the host's entry names it
    held = []
    try:
        try:
            held.append(os.open(os.path.dirname(runs), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            held.append(_open_dir(held[-1], os.path.basename(runs), create, "runs folder"))
            _own_dir(held[-1], runs, anchor=True)
            path = runs
            for name in below:
                path = path + "/" + name
                held.append(_open_dir(held[-1], name, create, "run dir"))
                _own_dir(held[-1], path)
            try:
                control = _open_dir(held[-1], CONTROL, create, "control folder")
            except FileNotFoundError:
                control = None
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise RuntimeError(f"refusing a run dir reached through a symlink or a file: {root}") from None
            raise
        run = RunDir(held.pop(), control)
        try:
            if control is not None:
                _own_dir(control, path + "/" + CONTROL)
        except BaseException:
            run.close()
            raise
        return run
    finally:
        for fd in held:
            os.close(fd)


def _claim(root, token):
    """Make the run dir this run's (its token), refusing a link, a folder not this user's, or another
    run's dir; the run dir, held open."""
    run = open_run(root, create=True)
    try:
        for fd in (run.control, run.fd):  # the token, in either layout
            found = _read_at(fd, "token")
            if found is not None and found != token:
                raise RuntimeError(f"run dir in use by another run: {root}")
            if _exists_at(fd, "token") and found is None:
                raise RuntimeError(f"refusing a run dir whose token is a link or not this user's: {root}")
        if _read_at(run.control, "token") is None:  # readable by all: other users' leases check it
            run.write("token", token, 0o644)
        return run
    except BaseException:
        run.close()
        raise


def _exists_at(fd, name):
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
        return True
    except OSError:
        return False


def _read_at(fd, name, limit=4096):
    """A small file's text in the folder `fd`: a plain file of this user's, never through a link; None
    when absent or anything else."""
    try:
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return None
    try:
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        return os.read(f, limit).decode(errors="replace").strip()
    finally:
        os.close(f)


def _write_at(fd, name, text, mode):
    """Write `name` in the folder `fd` whole: a fresh file renamed into place (a link there is replaced)."""
    tmp = f".{name}.{os.getpid()}.tmp"
    f = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    try:
        os.write(f, text.encode())
    finally:
        os.close(f)
    os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)


def _job_id_at(run):
    text = (run.read("job_id") or "").split(";")[0].strip()
    return int(text) if text.isdigit() else None


def job_id_of(root):
    """The batch job id recorded in the run dir; None when there is none, or the dir is not this user's."""
    try:
        with _opened(root) as run:
            return _job_id_at(run) if run is not None else None
    except RuntimeError:
        return None


class _opened:
    """`with _opened(root) as run`: the run dir held open (None when it does not exist)."""

    def __init__(self, root):
        self.run = open_run(root)

    def __enter__(self):
        return self.run

    def __exit__(self, *exc):
        if self.run is not None:
            self.run.close()


def submit(root, script, token, options, facts=None):
    """Write the job script and sbatch this program's wrapper in the run dir; the job id. Idempotent for
    the same token (a retry answers the job submitted before); a failed sbatch leaves no token behind,
    so the launch can be tried again. The wrapper checks the run dir again when the job starts: a queue
    wait is long."""
    with _claim(root, token) as run:
        known = _job_id_at(run)
        if known is not None:
            return {"job_id": known, "again": True}
        _write_at(run.fd, "job.sh", script, 0o600)  # its environment may hold secrets: the owner's only
        if facts is not None:  # the receipt's look at the host, taken on the node when the job starts
            run.write(FACTS_ASKED, json.dumps(facts), 0o600)
        # the batch script only starts the wrapper, through the bootstrap that checks this program's bytes
        run.write("batch.sh", "#!/bin/sh\nexec " + " ".join(
            _sh_word(w) for w in self_command("wrap", "--dir", root, "--run", run_mark(token))) + "\n", 0o755)
        try:
            out = _scheduler(["sbatch", *options, "--parsable", os.path.join(CONTROL, "batch.sh")], timeout=120,
                             cwd=run.cwd)
            head = out.strip().splitlines()[-1].split(";")[0].strip() if out.strip() else ""
            if not head.isdigit():
                raise RuntimeError(f"sbatch printed no job id: {out.strip()[:200]!r}")
        except Exception:
            os.unlink("token", dir_fd=run.control)
            raise
        run.write("job_id", head + "\n", 0o644)
        return {"job_id": int(head), "again": False}


def _sh_word(word):
    """One word for /bin/sh, single-quoted: the batch script's only line."""
    return "'" + word.replace("'", "'\\''") + "'"


def squeue(job_id):
    """Every job of this user that squeue still knows (finished ones too), or the one job asked for."""
    which = ["-j", str(job_id)] if job_id is not None else ["-u", pwd.getpwuid(os.getuid()).pw_name]
    return squeue_rows(_scheduler(["squeue", "-h", "-t", "all", *which, "-o", "%i|%T|%N|%j|%r"]))


def squeue_rows(text):
    """squeue's `%i|%T|%N|%j|%r` lines as their fields; lines that do not parse are skipped."""
    rows = []
    for line in text.splitlines():
        cells = line.split("|", 4)
        if len(cells) == 5 and cells[0].strip():
            rows.append(dict(zip(SQUEUE_FIELDS, (c.strip() for c in cells))))
    return rows


def sacct_rows(text):
    """sacct's `-P` lines of SACCT_FIELDS as their fields; a header or a line cut short is skipped."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 5 and cells[0].isdigit():
            rows.append(dict(zip(("job_id", "state", "node", "name", "exit_code"), cells[:5])))
    return rows


def sacct(ids):
    """The jobs from the accounting database, else (no slurmdbd) from the job-completion file."""
    listed = ",".join(str(i) for i in ids)
    for argv in (["sacct", "-n", "-P", "-X", "-j", listed], ["sacct", "-c", "-n", "-P", "-j", listed]):
        try:
            return sacct_rows(_scheduler(argv + ["-o", ",".join(SACCT_FIELDS)]))
        except (RuntimeError, OSError, subprocess.SubprocessError):
            continue
    return []


def scancel(job_id, kill):
    _scheduler(["scancel", "--signal=KILL", "--full", str(job_id)] if kill else ["scancel", str(job_id)])


def sinfo(what):
    """The scheduler's partitions (name, node count) or nodes (name, gres, gres used, state, partition)."""
    out = _scheduler(["sinfo", "-h", *SINFO_FORMATS[what]])
    sep = "|" if what == "nodes" else None
    return [[c.strip() for c in line.split(sep)] for line in out.splitlines() if line.strip()]


# -- a run dir ------------------------------------------------------------------------------------
def _read_small(path, limit=4096):
    """A small control file's text, never following a symlink; None when absent or unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return os.read(fd, limit).decode(errors="replace").strip()
    finally:
        os.close(fd)


def _number(text):
    try:
        return float(text)
    except (TypeError, ValueError):
        return None


def _int(text):
    text = (text or "").strip()
    return int(text) if text.lstrip("-").isdigit() else None


def control_dir(root):
    c = os.path.join(root, CONTROL)
    return c if os.path.isdir(c) else root  # a run dir from before the control folder


def launch(root, script, token):
    """Create the run dir, write the job script, start the wrapper (this program's `wrap` mode) as a
    session leader; its pid and start.

    Idempotent for the same token (a retry never starts the job twice); a run dir holding another
    run's token, or a symlink for its token, is refused, never reused. The run dir is opened once and
    the wrapper starts in the folder held, whatever is renamed meanwhile.
    """
    with _claim(root, token) as run:
        started = _adoptable(run, token)  # claimed before its patches, or a retried launch
        if started is not None:
            return {**started, "again": True}
        _write_at(run.fd, "job.sh", script, 0o600)  # its environment may hold secrets: the owner's only
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


def _pid_at(run):
    """The pid and start time the run's wrapper recorded (a plain file of this user's), or None."""
    fields = (run.read("pid") or "").split()
    if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
        return {"pid": int(fields[0]), "start": fields[1]}
    return None


def _adoptable(run, token):
    """The job a run dir's pid file names, when it is this run's: its wrapper, if still there, carries the
    run's mark in its own environment (a pid file naming any other process is refused, never adopted); a
    wrapper gone is answered as it was (nothing of it is signalled without its start time proved)."""
    job = _pid_at(run)
    if job is None:
        return None
    if live_start(job["pid"]) == job["start"] and not _marked(job["pid"], f"{RUN_MARK}={run_mark(token)}".encode()):
        raise RuntimeError(f"the run dir's pid file names process {job['pid']}, which is not this run's wrapper")
    return job


# The bootstrap orch starts this program with (hostprogram.BOOTSTRAP): the file's bytes run only when
# their sha256 is the one asked for. The wrapper is started through it too.
BOOTSTRAP = (
    "import sys\n"
    "sys.path[:] = [x for x in sys.path if x.startswith('/')]\n"
    "import hashlib\n"
    "p, want = sys.argv[1], sys.argv[2]\n"
    "try:\n"
    "    with open(p, 'rb') as f: code = f.read()\n"
    "except OSError: sys.exit(97)\n"
    "if hashlib.sha256(code).hexdigest() != want: sys.exit(97)\n"
    "sys.argv = [p] + sys.argv[3:]\n"
    "exec(compile(code, p, 'exec'), {'__name__': '__main__', '__file__': p, 'ORCH_SHA256': want})\n"
)


def own_digest():
    """The sha256 of the bytes running now: the bootstrap's checked one, else this file's."""
    given = globals().get("ORCH_SHA256")
    if given:
        return given
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def self_command(*args):
    """This program's own mode (the job wrapper), isolated (-I): it starts in the run dir, and nothing there,
    in PYTHON* variables or in the user's site folder decides what it imports."""
    return [sys.executable, "-I", "-c", BOOTSTRAP, os.path.abspath(__file__), own_digest(), *args]


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
        _write(os.path.join(CONTROL, "node"), node + "\n", 0o644)
    if root is not None:
        node_facts(node)
    _write(os.path.join(CONTROL, "started_at"), f"{time.time():.9f}\n", 0o644)
    pid = os.getpid()
    start = start_time(pid)
    os.environ[JOB_MARK] = f"{pid}:{start}"
    _write(os.path.join(CONTROL, "pid"), f"{pid} {start}\n", 0o644)
    log = os.open("log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    with open(os.devnull, "rb") as devnull:
        code = subprocess.call(["bash", "./job.sh"], stdin=devnull, stdout=log, stderr=log)
    os.close(log)
    code = code if code >= 0 else 128 - code  # killed by a signal: as a shell says it
    _write(os.path.join(CONTROL, "ended_at"), f"{time.time():.9f}\n", 0o644)
    _write(os.path.join(CONTROL, "exit_code"), f"{code}\n", 0o644)
    return code


def node_facts(node):
    """A batch job's receipt facts, looked at on its node before it starts, when its submission asked."""
    try:
        with open(os.path.join(CONTROL, FACTS_ASKED)) as f:
            asked = json.load(f)
        _write(os.path.join(CONTROL, FACTS), json.dumps({**host_facts(asked), "node": node}), 0o600)
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


def _write(path, text, mode):
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def find(root):
    """The pid and start time a run dir's wrapper recorded, when the run dir is this user's and the
    process, if it lives, is the wrapper of the run whose token the dir holds; else None."""
    try:
        with _opened(root) as run:
            token = None if run is None else run.read("token") or _read_at(run.fd, "token")
            return _adoptable(run, token) if token else None
    except RuntimeError:  # not this user's, or a pid file naming a process that is not the run's wrapper
        return None


def boot_time():
    """When this host booted (epoch seconds), from /proc/stat's btime."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def explain_loss(root, start):
    """What the host can say of a job gone without an exit code: a reboot since it started, a full disk,
    the OOM killer, or none of them."""
    booted = boot_time()
    started_at = _number(_read_small(os.path.join(control_dir(root), "started_at")))
    if booted is not None and started_at is not None and float(started_at) < booted:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(booted))
        return f"the host rebooted since the job started (booted at {when})"
    try:
        st = os.statvfs(root)
        free_kib = st.f_bavail * st.f_frsize // 1024
    except OSError:
        free_kib = None
    if free_kib is not None and free_kib < DISK_FULL_KIB:
        return (f"the job ended but its exit code could not be written: the disk of {root} is full "
                f"({free_kib} KiB free)")
    since = int(start) / os.sysconf("SC_CLK_TCK") if str(start).isdigit() else 0
    try:
        out = subprocess.run(["dmesg"], capture_output=True, timeout=10, check=False).stdout.decode(errors="replace")
    except (OSError, subprocess.SubprocessError):
        out = ""
    oom = ""
    for line in out.splitlines():
        if ("oom-kill" in line or "Out of memory" in line or "Killed process" in line) and "[" in line:
            stamp = _number(line.split("[", 1)[1].split("]", 1)[0])
            if stamp is not None and stamp >= since:
                oom = line.strip()
    if oom:
        return f"killed by the kernel's OOM killer: {oom[:200]}"
    if booted is not None and started_at is not None:  # the host has been up since the job started
        return "the process is gone and wrote no exit code (killed by SIGKILL with its wrapper; the host did not reboot)"
    return "the process is gone and wrote no exit code (killed by SIGKILL with its wrapper, or the host rebooted)"


def tail(path, lines, block=64 << 10, most=TAIL_BYTES):
    """The last `lines` lines of a file up to its size at one moment (from its last `most` bytes, however
    long its lines), and that size: a follow that starts there neither repeats nor drops a line."""
    try:
        fd = _open_plain(path)
    except OSError:
        return "", 0
    try:
        size = os.fstat(fd).st_size
        data, pos = b"", size
        while pos > max(0, size - most) and data.count(b"\n") <= lines:
            pos = max(0, size - most, pos - block)
            data = os.pread(fd, size - pos, pos)
        text = b"\n".join(data.split(b"\n")[-lines - 1:]).decode(errors="replace") if lines > 0 else ""
        return text, size
    finally:
        os.close(fd)


def read_chunk(path, offset, length):
    """Bytes of a file from `offset`, never through a symlink (a file swapped for one reads as empty)."""
    return _pread(path, offset, min(length, CHUNK))


def files_under(root, skip, most=100000):
    """(size, path relative to root) of the plain files under root, symlinks neither listed nor followed;
    the top-level folder `skip` left out (an earlier pull into the run dir)."""
    found = []
    for top, dirs, names in os.walk(root):
        if top == root and skip in dirs:
            dirs.remove(skip)
        for name in names:
            path = os.path.join(top, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found.append([st.st_size, os.path.relpath(path, root)])
                if len(found) >= most:
                    return found
    return found


def file_size(path):
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return st.st_size if not os.path.islink(path) else None


def _kind(mode):
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    return "dir" if stat.S_ISDIR(mode) else "other"


def path_stat(path):
    """What is at a path, the path itself not followed: its kind (file, dir, link, other; None when
    nothing is there) and size; for a symlink also the kind of what it points to ("to"), looked at but
    never read, so a check can answer as `test -f` does."""
    try:
        st = os.lstat(path)
    except OSError:
        return {"kind": None, "size": None, "to": None}
    kind = to = _kind(st.st_mode)
    if kind == "link":
        try:
            to = _kind(os.stat(path).st_mode)
        except OSError:
            to = None
    return {"kind": kind, "size": st.st_size, "to": to}


def list_dir(path, most):
    """[name, kind, size] of a directory's entries, sorted by name, no entry followed; None when there is no
    directory. The directory itself may be a symlink to one, as `files` and a shell's `cd` take it."""
    found = []
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                found.append([entry.name, _kind(st.st_mode), st.st_size])
                if len(found) >= most:
                    break
    except OSError:
        return None
    return sorted(found)


def usage(path):
    """How much a directory holds, as `find DIR -mindepth 1 | wc -l`, `du -sb` and `du -sk` count it:
    its entries at any depth, their bytes and their KiB on disk (the directory's own included); no
    symlink below it followed. None when there is no directory."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    entries, size, blocks = 0, st.st_size, getattr(st, "st_blocks", 0)
    for top, dirs, names in os.walk(path):  # symlinks to folders are listed in dirs, never walked
        for name in dirs + names:
            entries += 1
            try:
                inner = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            size += inner.st_size
            blocks += getattr(inner, "st_blocks", 0)
    return {"entries": entries, "bytes": size, "kib": blocks * 512 // 1024}


def run_argv(argv, timeout, most=1 << 20, data=None, env=None, name=None):
    """Run a command from its argv list, no shell, within `timeout` seconds, `data` on its stdin (else it is
    empty): its exit code and the last `most` bytes of its stdout and stderr. A program that cannot be
    started answers as a shell would (127 and why). This gives a request nothing new: `launch` already
    runs a script."""
    feed = {"stdin": subprocess.DEVNULL} if data is None else {"input": data}
    try:
        out = subprocess.run(argv, capture_output=True, timeout=timeout, env=env, check=False, **feed)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{name or argv[0]}: no end within {timeout:g} s (killed)") from None
    except OSError as exc:
        return {"code": 127, "stdout": "", "stderr": f"{argv[0]}: {exc.strerror or exc}\n"}
    return {"code": out.returncode, "stdout": out.stdout[-most:].decode(errors="replace"),
            "stderr": out.stderr[-most:].decode(errors="replace")}


def run_program(python, path, sha256, data, pythonpath, timeout):
    """Run one of orch's placed host programs (its leases, its patcher): `python` starts the bootstrap,
    which runs the file's bytes only when their sha256 is `sha256` (else it exits 97 having run nothing),
    with `data`, the program's JSON request, on its stdin. No shell; `pythonpath`, when given, is the
    program's PYTHONPATH."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return run_argv([python, "-c", BOOTSTRAP, path, sha256], timeout, 16 << 20, data.encode(), env,
                    os.path.basename(path))


def health(url, timeout):
    """The HTTP status of a server's endpoint, asked on this host; None when nothing answered."""
    # imported here: urllib.request was a third of the time this program took to start (the agent's
    # connection, and every job's wrapper), and only this op needs it
    import urllib.error
    import urllib.request

    try:
        return urllib.request.urlopen(url, timeout=timeout).status
    except urllib.error.HTTPError as exc:
        return exc.code
    except Exception:  # noqa: BLE001 - refused, reset, timed out: nothing answered
        return None


# -- following a run --------------------------------------------------------------------------------
class Followed:
    """One run's log and job, as last pushed."""

    def __init__(self, req):
        self.key = str(req["key"])
        self.root = req["dir"]
        self.scheduled = bool(req.get("scheduled"))  # a batch job: its scheduler says whether it lives
        self.pid = int(req.get("pid") or 0)
        self.start = str(req.get("start") or "")
        self.offset = int(req.get("offset") or 0)
        self.inode = req.get("inode")
        self.tail = bytes.fromhex(req.get("tail") or "")  # the bytes the watcher has before its offset
        self.src = None  # a rotated file still being read (its path), else the log
        self.fd = None  # held open on the file the job writes (inode `self.inode`): read even once renamed away
        self.last = None  # what the last push said of the job
        self.group_seen = 0.0
        self.group_alive = False
        self.wanted = True  # push at the next tick even without news (a new follow, a poke)
        self.seen = None  # (size, inode) of the log at the last tick: unchanged, nothing to check
        self.chunk = CHUNK
        self.behind = False  # the last push left bytes of the log unread: more at once, not at the next tick

    @property
    def log(self):
        return os.path.join(self.root, "log")

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _keep(self, ino):
        """The log's identity is `ino` from now on: hold the file open, so that it is read by its inode
        whatever becomes of its name."""
        if self.fd is not None and os.fstat(self.fd).st_ino == ino:
            self.inode = ino
            return
        self.close()
        self.inode = ino
        if ino is None:
            return
        try:
            fd = _open_plain(self.log)
        except OSError:
            return
        if os.fstat(fd).st_ino == ino:
            self.fd = fd
        else:  # replaced again meanwhile: found by inode at the next look
            os.close(fd)

    def _own(self):
        """The file the job writes, by its inode, when its name no longer leads to it (renamed away, or
        replaced by a symlink, a fifo or a device): the held file, else found in the run dir, else the one
        the job's wrapper writes to (a plain file it holds open for appending). None when none is known."""
        if self.fd is not None:
            return self.fd
        if self.inode is not None:
            found = _by_inode(self.root, self.inode)
            if found is not None:
                return found
        if self.scheduled or not self.pid or live_start(self.pid) != self.start:
            return None  # only a wrapper proven the job's is asked
        fd = _written_by(self.pid)
        if fd is None:
            return None
        ino = os.fstat(fd).st_ino
        if live_start(self.pid) != self.start or (self.inode is not None and ino != self.inode):
            os.close(fd)  # the pid went to another process meanwhile, or it writes another file
            return None
        self.inode, self.fd = ino, fd  # (never seen at its name: the log of this run is what its wrapper writes)
        return fd

    def alive(self, now):
        if self.scheduled:  # the job runs on a node, not here: its scheduler says whether it lives
            return False, True
        wrapper = live_start(self.pid) == self.start if self.pid else False
        if wrapper or not self.start.isdigit():
            return wrapper, wrapper
        if now - self.group_seen >= GROUP_CHECK_S:  # /proc is walked at most this often
            self.group_seen = now
            self.group_alive = ours(self.pid, self.start) is not None
        return self.group_alive, wrapper

    def _same(self, path, offset):
        """Are the bytes before `offset` in `path` those the watcher read there?"""
        if not self.tail or offset <= 0:
            return True
        n = min(len(self.tail), offset)
        return _pread(path, offset - n, n) == self.tail[-n:]

    def _choose(self, size, ino):
        """The file to read and from where, by the log's identity (see the module's rotation rules)."""
        if self.src is not None:
            return self.src, True
        if ino is None:  # no plain file at the log's name: the file the job writes, by inode, if known
            own = self._own()
            return (own, False) if own is not None else (self.log, False)
        if (size, ino) == self.seen and ino == self.inode:
            return self.log, False
        self.seen = (size, ino)
        if self.inode is not None and ino is not None and ino != self.inode:
            old = self._own()
            if old is not None:
                osize = _size(old)
                if size == 0:  # renamed away, the wrapper still writes to the old file
                    return old, False
                if osize > self.offset:
                    self.src = old
                    return old, True
            self.offset, self.tail = 0, b""
            self._keep(ino)
            return self.log, False
        if size < self.offset or not self._same(self.log, self.offset):
            copy = self.log + ".1"  # copytruncate: the rest is in the copy
            if _size(copy) > self.offset and self._same(copy, self.offset):
                self.src = copy
                return copy, True
            self.offset, self.tail = 0, b""
        self._keep(ino)
        return self.log, False

    def state(self, now):
        """What changed since the last push, or None when nothing did and nothing was asked."""
        alive, wrapper = self.alive(now)
        control = control_dir(self.root)
        exit_code = _int(_read_small(os.path.join(control, "exit_code")))
        node = _node(_read_small(os.path.join(control, "node"), 200))  # a batch job's, noted on its node
        present = os.path.isdir(self.root)
        try:
            st = os.lstat(self.log)
        except OSError:
            st = None
        # a symlink, a fifo or a device at the log's name is refused: never opened, never sized through
        size, ino = (st.st_size, st.st_ino) if st is not None and stat.S_ISREG(st.st_mode) else (0, None)
        path, rotated = self._choose(size, ino)
        if path != self.log:
            size = _size(path)
        data = _pread(path, self.offset, min(self.chunk, max(0, size - self.offset)))
        # more to read at once; not when nothing could be read (an unreadable log waits for the tick)
        self.behind = bool(data) and self.offset + len(data) < size
        brief = (alive, wrapper, exit_code, present, node)
        if not data and brief == self.last and not self.wanted and not rotated:
            return None
        self.wanted = False
        self.last = brief
        doc = {"push": "state", "key": self.key, "alive": alive, "wrapper": wrapper, "exit_code": exit_code,
               "size": size, "offset": self.offset, "data": data,
               "run_dir": present, "inode": self.inode if path == self.log else _ino(path), "node": node,
               "rotated": rotated,
               "started_at": _number(_read_small(os.path.join(control, "started_at"))),
               "ended_at": _number(_read_small(os.path.join(control, "ended_at")))}
        self.offset += len(data)
        self.tail = (self.tail + data)[-TAIL_MARK:]
        if rotated and self.offset >= size:  # the rest of the old file is out: the new log from 0
            self.src, self.offset, self.tail = None, 0, b""
            self._keep(None)
            self.wanted = True
        return doc


def hold(f, hold_s, wakes):
    """Wait up to `hold_s` for news of a followed run: its end, a log cut under the offset, or a new line
    matching one of `wakes` (looked for only in the bytes that came since the last look)."""
    deadline = time.monotonic() + hold_s
    seen = f.offset
    while time.monotonic() < deadline:
        alive, _ = f.alive(time.monotonic())
        if not alive or _read_small(os.path.join(control_dir(f.root), "exit_code")) is not None:
            return
        size = _size(f.log)
        if size < seen:
            return
        if size > seen and wakes:
            start = max(seen - 4096, f.offset)  # a margin for a line the last look saw half of
            text = _pread(f.log, start, min(size - start, 4 * CHUNK)).decode(errors="replace")
            if any(w.search(text) for w in wakes):
                return
            seen = size
        time.sleep(min(HOLD_STEP_S, max(0.0, deadline - time.monotonic())))


def _patterns(texts):
    """The wake patterns that compile; one that does not simply never wakes."""
    found = []
    for text in texts:
        try:
            found.append(re.compile(text, re.MULTILINE))
        except re.error:
            pass
    return found


def _node(text):
    """A node name as the batch script noted it, with anything a node name cannot hold dropped."""
    name = "".join(c for c in (text or "") if c.isalnum() or c in "_.-")
    return name or None


def _plain(path):
    """The stat of a plain file at `path` (an open fd: that file), the name not followed; None otherwise."""
    try:
        st = os.fstat(path) if isinstance(path, int) else os.lstat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _size(path):
    st = _plain(path)
    return st.st_size if st is not None else 0


def _ino(path):
    st = _plain(path)
    return st.st_ino if st is not None else None


def _open_plain(path):
    """A plain file opened for reading: never through a symlink, never waiting on a fifo or a device
    (opened without blocking, then refused); OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a plain file", path)
    return fd


def _pread(path, offset, length):
    """Bytes of a plain file (a path, or a file held open) from `offset`; b"" for anything else."""
    if length <= 0:
        return b""
    if isinstance(path, int):
        return os.pread(path, length, offset)
    try:
        fd = _open_plain(path)
    except OSError:
        return b""
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _written_by(pid):
    """A new read-only open of the plain file the wrapper `pid` holds open for appending (the job's log,
    which it hands the job as stdout and stderr), or None."""
    fds = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fds)
    except OSError:
        return None
    for name in names:
        try:
            with open(f"/proc/{pid}/fdinfo/{name}") as info:
                flags = next((int(line.split()[1], 8) for line in info if line.startswith("flags:")), 0)
        except (OSError, ValueError):
            continue
        if not flags & os.O_APPEND or flags & os.O_ACCMODE != os.O_WRONLY:
            continue
        try:
            fd = os.open(os.path.join(fds, name), os.O_RDONLY | os.O_NONBLOCK)  # the open file, whatever its name
        except OSError:
            continue
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        os.close(fd)
    return None


def _by_inode(root, inode):
    try:
        for entry in os.scandir(root):
            if entry.is_file(follow_symlinks=False) and entry.inode() == inode:
                return entry.path
    except OSError:
        pass
    return None


# -- the loop -------------------------------------------------------------------------------------------
# -- requests --------------------------------------------------------------------------------------------
# Every argument of every op is checked here before the op runs: a request names files, pids and numbers,
# nothing in it is evaluated, and a field an op does not know refuses the request.
def _path(v):
    return isinstance(v, str) and v.startswith("/") and "\0" not in v and len(v) < 4096


def _count(v):
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62


def _ticks(v):
    return isinstance(v, str) and len(v) < 32 and (v == "" or v.isdigit())


def _seconds(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 86400


def _text(v):
    return isinstance(v, str)


def _word(v):
    return isinstance(v, str) and 0 < len(v) <= 256 and all(c.isalnum() or c in "-_.:" for c in v)


def _token(v):
    return isinstance(v, str) and 0 < len(v) <= 4096 and not any(c in v for c in "\0\n\r")


def _option(v):
    return isinstance(v, str) and v.startswith("-") and len(v) <= 4096 and not any(c in v for c in "\0\n\r")


def _arg(v):
    return isinstance(v, str) and "\0" not in v and len(v) <= 1 << 20


def _argv(v):
    return isinstance(v, list) and 0 < len(v) <= 4096 and all(_arg(x) for x in v) and v[0] != ""


def _arg_word(v):
    return _arg(v) and v != "" and len(v) < 4096


def _sha256(v):
    return isinstance(v, str) and len(v) == 64 and _hex(v)


def _maybe_word(v):
    return v == "" or _word(v)


def _hex(v):
    return isinstance(v, str) and len(v) % 2 == 0 and all(c in "0123456789abcdef" for c in v)


def _flag(v):
    return isinstance(v, bool)


def _url(v):
    return isinstance(v, str) and v.startswith(("http://", "https://")) and len(v) < 2048 and not any(
        c.isspace() for c in v)


def _facts(v):
    """What a launch is asked to look at for the run's receipt: the engine's python and distributions, and
    the model's config files."""
    return (isinstance(v, dict) and set(v) <= {"python", "packages", "files", "gpus"} and _flag(v.get("gpus", True))
            and _maybe(_arg_word)(v.get("python")) and _list_of(_word, 32)(v.get("packages", []))
            and _list_of(_path, 64)(v.get("files", [])))


def _maybe(check):
    return lambda v: v is None or check(v)


def _list_of(check, most=10000):
    return lambda v: isinstance(v, list) and len(v) <= most and all(check(x) for x in v)


def _pid_start(v):
    return isinstance(v, list) and len(v) == 2 and _count(v[0]) and v[0] > 0 and _ticks(v[1]) and v[1] != ""


REQUIRED = object()
# op -> {argument: (check, default)}
ARGS = {
    "hello": {}, "ping": {},
    # a batch job is followed under its scheduler's handle (job id, "slurm:<name>"): never signalled here
    "follow": {"key": (_word, REQUIRED), "dir": (_path, REQUIRED), "pid": (_count, 0), "start": (_maybe_word, ""),
               "offset": (_count, 0), "inode": (_maybe(_count), None), "tail": (_hex, ""),
               "scheduled": (_flag, False)},
    "unfollow": {"key": (_word, REQUIRED)},
    "poke": {"keys": (_list_of(_word), [])},
    "ack": {"bytes": (_count, REQUIRED)},
    "launch": {"dir": (_path, REQUIRED), "script": (_text, REQUIRED), "token": (_token, REQUIRED),
               "facts": (_maybe(_facts), None)},
    "kill": {"pid": (_count, REQUIRED), "start": (_ticks, REQUIRED), "grace_s": (_seconds, REQUIRED)},
    "stacks": {"pid": (_count, REQUIRED), "start": (_ticks, "")},
    "kill_pids": {"procs": (_list_of(_pid_start, 4096), REQUIRED), "grace_s": (_seconds, REQUIRED)},
    "find": {"dir": (_path, REQUIRED)},
    "loss": {"dir": (_path, REQUIRED), "start": (_ticks, "")},
    "read": {"dir": (_path, REQUIRED), "pid": (_count, 0), "start": (_ticks, ""), "offset": (_count, 0),
             "max_bytes": (_count, CHUNK), "inode": (_maybe(_count), None), "tail": (_hex, ""),
             "hold_s": (_seconds, 0), "wake": (_list_of(_text, 8), []), "scheduled": (_flag, False)},
    "tail": {"path": (_path, REQUIRED), "lines": (_count, REQUIRED)},
    "chunk": {"path": (_path, REQUIRED), "offset": (_count, 0), "length": (_count, CHUNK)},
    "size": {"path": (_path, REQUIRED)},
    "stat": {"path": (_path, REQUIRED)},
    "listdir": {"path": (_path, REQUIRED), "most": (_count, 100000)},
    "usage": {"path": (_path, REQUIRED)},
    "exec": {"argv": (_argv, REQUIRED), "timeout_s": (_seconds, 120)},
    "program": {"python": (_arg_word, REQUIRED), "path": (_path, REQUIRED), "sha256": (_sha256, REQUIRED),
                "input": (_text, ""), "pythonpath": (_maybe(_arg), None), "timeout_s": (_seconds, 120)},
    "submit": {"dir": (_path, REQUIRED), "script": (_text, REQUIRED), "token": (_token, REQUIRED),
               "options": (_list_of(_option, 256), []), "facts": (_maybe(_facts), None)},
    "squeue": {"job_id": (_maybe(_count), None)},
    "sacct": {"ids": (_list_of(_count, 10000), REQUIRED)},
    "scancel": {"job_id": (_count, REQUIRED), "kill": (_flag, False)},
    "sinfo": {"what": (lambda v: v in SINFO_FORMATS, REQUIRED)},
    "files": {"dir": (_path, REQUIRED), "skip": (_word, "pulled")},
    "health": {"url": (_url, REQUIRED), "timeout_s": (_seconds, 5)},
    "gpus": {"timeout_s": (_seconds, 60), "facts": (_flag, False)},
    "port": {},
}
OPS = tuple(ARGS)
MAX_READ = 16 << 20  # the most log bytes one read answers with


def checked(op, req):
    """The op's arguments from a request, each one checked; raises ValueError naming what is wrong."""
    spec = ARGS[op]
    unknown = sorted(set(req) - set(spec) - {"id", "op"})
    if unknown:
        raise ValueError(f"{op}: unknown argument(s) {', '.join(unknown)}")
    args = {}
    for name, (check, default) in spec.items():
        if name not in req:
            if default is REQUIRED:
                raise ValueError(f"{op}: missing argument {name}")
            args[name] = default
        elif not check(req[name]):
            raise ValueError(f"{op}: bad {name}: {str(req[name])[:80]!r}")
        else:
            args[name] = req[name]
    return args


class Agent:
    def __init__(self):
        self.followed = {}
        self.lock = threading.Lock()
        self.unacked = 0  # log bytes pushed that the watcher has not acknowledged yet (at most WINDOW)
        self.turn = 0

    def hello(self, a):
        boot = _read_small("/proc/sys/kernel/random/boot_id")
        u = os.uname()
        return {"sha256": own_digest(), "pid": os.getpid(), "boot_id": boot, "time": time.time(),
                "python": sys.version.split()[0], "uname": f"{u.sysname} {u.release} {u.machine}"}

    def follow(self, a):
        with self.lock:
            old, self.followed[a["key"]] = self.followed.get(a["key"]), Followed(a)
        if old is not None:
            old.close()
        return {}

    def unfollow(self, a):
        with self.lock:
            old = self.followed.pop(a["key"], None)
        if old is not None:
            old.close()
        return {}

    def poke(self, a):
        with self.lock:
            for key in a["keys"]:
                if key in self.followed:
                    self.followed[key].wanted = True
        return {}

    def ping(self, a):
        return {}

    def ack(self, a):
        """The watcher is done with `bytes` of pushed log: room for as many more. (Never below zero: an
        acknowledgement may name pushes of this agent's predecessor on another link.)"""
        self.unacked = max(0, self.unacked - a["bytes"])
        return {}

    def launch(self, a):
        # the host as the job finds it, looked at before it starts (the GPUs' processes: not yet its own)
        facts = host_facts(a["facts"]) if a["facts"] is not None else None
        job = launch(a["dir"], a["script"], a["token"])
        return job if facts is None else {**job, "facts": facts}

    def kill(self, a):
        return {"outcome": kill(a["pid"], a["start"], a["grace_s"])}

    def stacks(self, a):
        return {"text": stacks(a["pid"], a["start"])}

    def kill_pids(self, a):
        return {"outcome": kill_pids([(int(p), s) for p, s in a["procs"]], a["grace_s"])}

    def find(self, a):
        return {"job": find(a["dir"]), "job_id": job_id_of(a["dir"])}

    def loss(self, a):
        return {"reason": explain_loss(a["dir"], a["start"])}

    def read(self, a):
        """A run's state, as a push would say it, after holding up to hold_s for news."""
        f = Followed({**a, "key": "read"})
        f.chunk = min(a["max_bytes"], MAX_READ)
        try:
            if a["hold_s"] > 0:
                hold(f, a["hold_s"], _patterns(a["wake"]))
            doc = f.state(time.monotonic())
        finally:
            f.close()
        doc.pop("push", None)
        doc.pop("key", None)
        return doc

    def tail(self, a):
        text, size = tail(a["path"], a["lines"])
        return {"text": text, "size": size}

    def chunk(self, a):
        return {"data": read_chunk(a["path"], a["offset"], a["length"])}

    def submit(self, a):
        return submit(a["dir"], a["script"], a["token"], a["options"], a["facts"])

    def squeue(self, a):
        return {"jobs": squeue(a["job_id"])}

    def sacct(self, a):
        return {"jobs": sacct(a["ids"]) if a["ids"] else []}

    def scancel(self, a):
        scancel(a["job_id"], a["kill"])
        return {}

    def sinfo(self, a):
        return {"rows": sinfo(a["what"])}

    def files(self, a):
        return {"files": files_under(a["dir"], a["skip"])}

    def size(self, a):
        return {"size": file_size(a["path"])}

    def stat(self, a):
        return path_stat(a["path"])

    def listdir(self, a):
        return {"entries": list_dir(a["path"], a["most"])}

    def usage(self, a):
        return {"usage": usage(a["path"])}

    def exec(self, a):
        return run_argv(a["argv"], float(a["timeout_s"]))

    def program(self, a):
        return run_program(a["python"], a["path"], a["sha256"], a["input"], a["pythonpath"], float(a["timeout_s"]))

    def health(self, a):
        return {"code": health(a["url"], float(a["timeout_s"]))}

    def gpus(self, a):
        try:
            return {"nvidia_smi": True, **gpus(float(a["timeout_s"]), a["facts"])} if shutil.which("nvidia-smi") else {
                "nvidia_smi": False}
        except (GpuError, OSError, subprocess.SubprocessError) as exc:
            return {"nvidia_smi": True, "error": str(exc) or type(exc).__name__}

    def port(self, a):
        """A TCP port free on every address of this host now: a multi-node run's rendezvous, which its head's
        job binds when it starts (the kernel hands out ephemeral ports in turn, so the same one comes back
        only after the whole range went round)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return {"port": s.getsockname()[1]}

    # answered from a thread: pushes and other requests go on meanwhile
    SLOW = ("launch", "kill", "kill_pids", "stacks", "loss", "health", "tail", "find", "read", "chunk", "gpus", "files",
            "submit", "squeue", "sacct", "scancel", "sinfo", "listdir", "usage", "exec",
            "program")

    def handle(self, line):
        try:
            req = json.loads(line)
            op = req["op"]
            rid = req.get("id")
        except (ValueError, KeyError, TypeError, AttributeError):
            send({"id": None, "ok": False, "error": f"not a request: {line[:200]!r}"})
            return
        if op not in OPS:
            send({"id": rid, "ok": False, "error": f"unknown op: {str(op)[:80]!r}"})
            return
        try:
            args = checked(op, req)
        except ValueError as exc:
            send({"id": rid, "ok": False, "error": str(exc)})
            return
        fn = getattr(self, op)
        if op in self.SLOW:
            threading.Thread(target=self.answer, args=(fn, rid, args), daemon=True).start()
        else:
            self.answer(fn, rid, args)

    def answer(self, fn, rid, args):
        try:
            send({"id": rid, "ok": True, "result": fn(args)})
        except Exception as exc:  # noqa: BLE001 - an op's failure is its reply; the agent goes on
            send({"id": rid, "ok": False, "error": str(exc) or type(exc).__name__})

    def tick(self):
        """Push what changed of every followed run; True when a run has more of its log to push now."""
        now = time.monotonic()
        with self.lock:
            runs = list(self.followed.values())
        self.turn = (self.turn + 1) % max(1, len(runs))
        more = False
        for run in runs[self.turn:] + runs[:self.turn]:  # a different run first each tick: a window shared fairly
            run.chunk = max(0, min(CHUNK, WINDOW - self.unacked))
            try:
                doc = run.state(now)
            except Exception as exc:  # noqa: BLE001 - one run's trouble (a vanished dir) is that run's, not the agent's
                doc = {"push": "trouble", "key": run.key, "error": str(exc)}
                run.behind = False  # said once a tick, not over and over
            if doc is not None:
                self.unacked += len(doc.get("data") or b"")
                send(doc)
            more = more or (run.behind and self.unacked < WINDOW)
        return more

    def serve(self):
        sel = selectors.DefaultSelector()
        sel.register(0, selectors.EVENT_READ)
        buf = b""
        heard = beat = time.monotonic()
        more = False
        while True:
            if sel.select(0 if more else TICK_S):  # a backlog goes out at once, chunk after chunk
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    return  # the watcher closed the channel
                heard = time.monotonic()
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        self.handle(line.decode(errors="replace"))
            more = self.tick()
            now = time.monotonic()
            if now - beat >= BEAT_S:
                beat = now
                send({"push": "beat", "time": time.time()})
            if now - heard > IDLE_EXIT_S:
                return


if __name__ == "__main__":
    if sys.argv[1:2] == ["wrap"]:
        opts = sys.argv[2:]
        given = dict(zip(opts[::2], opts[1::2])) if "--detach" not in opts else {}
        sys.exit(wrap("--detach" in opts, given.get("--dir"), given.get("--run")))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # the channel gone: end quietly
    try:
        Agent().serve()
    except (BrokenPipeError, KeyboardInterrupt):
        pass
