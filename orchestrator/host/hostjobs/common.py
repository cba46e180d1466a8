"""What every part of the host side shares: the control folder's name, the marks a job and its wrapper carry,
and the one way a small file is written whole."""

import hashlib
import os
import time

ENTRIES = ("patch",)  # what main() runs besides the agent and the wrapper, under a python of its own
CHUNK = 1 << 20  # log bytes per push; a backlog goes out as consecutive pushes

TAIL_BYTES = 1 << 20  # the last lines of a log come from its last MiB, however long its lines
TAIL_MARK = 64  # bytes before an offset that must still be there, or the log was rewritten under it
CONTROL = ".orch"  # a run dir's control folder: token, pid, exit code
JOB_MARK = "ORCH_JOB"
FACTS_ASKED, FACTS = "facts_asked.json", "facts.json"  # a batch job's receipt facts: asked at submission, seen on its node

RUN_MARK = "ORCH_RUN"  # in the wrapper's own environment: which run's wrapper it is (a digest of its token)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

def run_mark(token):
    return hashlib.sha256(token.encode()).hexdigest()[:32]

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

def _node(text):
    """A node name as the batch script noted it, with anything a node name cannot hold dropped."""
    name = "".join(c for c in (text or "") if c.isalnum() or c in "_.-")
    return name or None


def write_whole(name, data, mode=0o644, dir_fd=None, exact=False, sync=False):
    """Write the file `name` whole (in the folder `dir_fd` when given): a fresh name, never opened through a
    link, renamed into place, so a reader sees the old file or the new one and a link planted at `name` is
    replaced, never written through; nothing is left behind when the rename is refused (another user's file
    in a sticky folder). `exact`: the mode as given, whatever the umask."""
    folder, base = os.path.split(name)
    tmp = os.path.join(folder, f".{base}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        try:
            if exact:
                os.fchmod(fd, mode)
            view = memoryview(data.encode() if isinstance(data, str) else data)
            while view:
                view = view[os.write(fd, view):]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
