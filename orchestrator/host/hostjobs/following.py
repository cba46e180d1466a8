"""Following a run: its log's new bytes, its end and its liveness, as a push says them."""

import os
import re
import stat
import time

from .common import CHUNK, TAIL_MARK, _int, _node, _number, _read_small
from .files import _ino, _open_plain, _pread, _size
from .procs import live_start, ours
from .rundirs import control_dir

HOLD_STEP_S = 0.2  # how often a held read looks for news
GROUP_CHECK_S = 0.5  # a wrapper-less group is looked for in /proc at most this often


class FollowedLog:
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
