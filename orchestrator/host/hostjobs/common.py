"""What every part of the host side shares: the control folder's name, the marks a job and its wrapper carry,
and the one way a small file is written whole."""

import errno
import hashlib
import os
import stat
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

READ_MAX = 64 << 10  # no lease, token, pid or other control file is anywhere near this


class Refusal(RuntimeError):
    """A request the host side cannot do (a symlink where a file must be, a folder not this user's...);
    `kind` and `fields` go into the reply's error."""

    def __init__(self, message, kind="refused", **fields):
        RuntimeError.__init__(self, message)
        self.message, self.kind, self.fields = message, kind, fields

    def as_dict(self):
        return dict(self.fields, kind=self.kind, message=self.message)


def read_small(path, limit=READ_MAX, dir_fd=None, uid=None):
    """The text of a small file (`path` in the folder `dir_fd` when given), or None when there is none.
    Never through a symlink nor waiting on a fifo: a symlink, anything but a regular file, or, when `uid` is
    given, a file of another owner is refused (Refusal); any other failure to read raises (OSError)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refusal(f"{path} is a symlink; refusing to read it", kind="symlink", path=path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refusal(f"{path} is not a regular file", kind="not-a-file", path=path)
        if uid is not None and st.st_uid != uid:
            raise Refusal(f"{path} belongs to uid {st.st_uid}", kind="owner", path=path)
        return os.read(fd, limit).decode("utf-8", "replace")
    finally:
        os.close(fd)


def quiet_text(path, limit=READ_MAX, dir_fd=None, uid=None):
    """`read_small`, stripped, with None for whatever it refuses or cannot read (a control file is only
    believed when it is plainly there)."""
    try:
        text = read_small(path, limit, dir_fd, uid)
    except (Refusal, OSError):
        return None
    return None if text is None else text.strip()


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
