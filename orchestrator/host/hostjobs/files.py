"""Files on the host: tails, chunks, listings and sizes, a command run from its argv, a health check."""

import errno
import os
import stat
import subprocess

from .boot import BOOTSTRAP
from .common import CHUNK, TAIL_BYTES


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


def run_program(python, path, sha256, entry, data, pythonpath, timeout):
    """Run an entry of the placed archive that needs a python of its own (the patcher, under a run's python):
    `python` starts the bootstrap, which imports the archive only when its sha256 is `sha256` (else it exits
    97 having run nothing), with `data`, the entry's JSON request, on its stdin. No shell; `pythonpath`,
    when given, is its PYTHONPATH."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return run_argv([python, "-c", BOOTSTRAP, path, sha256, entry], timeout, 16 << 20, data.encode(), env,
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
