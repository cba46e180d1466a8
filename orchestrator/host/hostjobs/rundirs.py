"""A run dir, opened once and held: reached only through this user's folders, none a link, every later
read and write relative to the descriptors held; the job it records, and what the host can say of a job
that is gone."""

import errno
import os
import stat
import subprocess
import time

from .common import CONTROL, DIR_FLAGS, RUN_MARK, Refusal, _number, quiet_text, run_mark, write_whole
from .procs import _marked, live_start

DISK_FULL_KIB = 64
WRAPPER_LEAVING_S = 2.0  # how long a process the pid file names may live on without the run's mark (see _adoptable)

# A shared workdir's group can write in `<workdir>/runs/`: a run dir is reached only through folders this
# user owns (`runs/` itself this user's, root's, or sticky), each opened without following a link, and
# everything after is done relative to the descriptors held, so a folder renamed or swapped meanwhile is
# never used.

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
        write_whole(name, text, mode, dir_fd=self.control)


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


def claim_run_dir(root, token):
    """Make the run dir this run's (its token), refusing a link, a folder not this user's, or another
    run's dir; the run dir, held open."""
    run = open_run(root, create=True)
    try:
        for fd in (run.control, run.fd):  # the token, in either layout
            found = _read_at(fd, "token")
            if found is not None and found != token:
                raise Refusal(f"run dir in use by another run: {root}", kind="dir-in-use", path=root)
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
    return quiet_text(name, limit, dir_fd=fd, uid=os.geteuid())


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

def control_dir(root):
    c = os.path.join(root, CONTROL)
    return c if os.path.isdir(c) else root  # a run dir from before the control folder

def _pid_at(run):
    """The pid and start time the run's wrapper recorded (a plain file of this user's), or None."""
    fields = (run.read("pid") or "").split()
    if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
        return {"pid": int(fields[0]), "start": fields[1]}
    return None


def _adoptable(run, token):
    """The job a run dir's pid file names, when it is this run's: its wrapper, if still there, carries the
    run's mark in its own environment (a pid file naming any other process is refused, never adopted); a
    wrapper gone is answered as it was (nothing of it is signalled without its start time proved). A wrapper
    that wrote its exit code lives on a moment without its memory, where the mark is: a process without the
    mark is given WRAPPER_LEAVING_S to be gone before the pid file is refused."""
    job = _pid_at(run)
    if job is None:
        return None
    mark = f"{RUN_MARK}={run_mark(token)}".encode()
    deadline = time.monotonic() + WRAPPER_LEAVING_S
    while live_start(job["pid"]) == job["start"] and not _marked(job["pid"], mark):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the run dir's pid file names process {job['pid']}, which is not this run's wrapper")
        time.sleep(0.05)
    return job

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
    started_at = _number(quiet_text(os.path.join(control_dir(root), "started_at")))
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
