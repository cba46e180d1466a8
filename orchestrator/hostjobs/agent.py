"""orch's agent on a host: one stdlib-only Python program per watcher connection, speaking JSON lines.

orch places this file in the host's workdir under its content hash and starts it over one SSH channel
(or as a child process on this machine). Requests come on stdin, one JSON object a line:
`{"id": N, "op": NAME, ...}`; each gets one reply `{"id": N, "ok": true, "result": {...}}` or
`{"id": N, "ok": false, "error": TEXT}`. Without being asked, the agent pushes what happens, as it
happens: `{"push": "state", "key": K, ...}` for a followed run whose log grew (bytes batched over one
tick), whose job ended or whose liveness changed, and `{"push": "beat"}` every BEAT_S, so the other end
tells a quiet host from a dark link.

Nothing here is run through a shell, and nothing read from a file on the host is evaluated: a job is
known by its wrapper's pid and start time (field 22 of /proc/PID/stat), proved again before every
signal. It exits when its stdin closes or stays silent for IDLE_EXIT_S (the watcher is gone).

Runs on the host's python (3.8 or newer): no annotations evaluated, no third-party imports.
"""

import base64
import hashlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

TICK_S = 0.05  # how often followed logs and jobs are looked at; a push batches the bytes of one tick
BEAT_S = 2.0
IDLE_EXIT_S = 60.0  # the watcher pings every few seconds; this long without a word, it is gone
CHUNK = 1 << 20  # log bytes per push; a backlog goes out as consecutive pushes
GROUP_CHECK_S = 0.5  # a wrapper-less group is looked for in /proc at most this often
CONTROL = ".orch"
JOB_MARK = "ORCH_JOB"
TAIL_MARK = 64  # bytes before an offset compared, to tell a log rewritten under it
DISK_FULL_KIB = 64

_out_lock = threading.Lock()


def send(doc):
    data = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    with _out_lock:
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
    mark = f"{JOB_MARK}={int(pid)}:{start}".encode()
    members = [m for m in group_pids(pid)
               if int(start_time(m) or 0) >= int(start) and _marked(m, mark)]
    return members or None


def signal_job(pid, start, sig):
    """Signal what is provably the job's; False when nothing is."""
    who = ours(pid, start)
    if who is None:
        return False
    try:
        if who == "group":
            os.killpg(int(pid), sig)
        else:
            for m in who:
                os.kill(m, sig)
    except ProcessLookupError:
        pass
    return True


def kill(pid, start, grace_s):
    """SIGTERM, a grace period, SIGKILL: 'gone' | 'stopped' | 'killed'."""
    if not signal_job(pid, start, signal.SIGTERM):
        return "gone"
    deadline = time.monotonic() + max(0.0, float(grace_s))
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if ours(pid, start) is None:
            return "stopped"
    return "killed" if signal_job(pid, start, signal.SIGKILL) else "stopped"


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


def launch(root, script, wrapper, token):
    """Create the run dir, write the scripts, start the wrapper as a session leader; its pid and start.

    Idempotent for the same token (a retry never starts the job twice); a run dir holding another
    run's token, or a symlink for its token, is refused, never reused.
    """
    os.makedirs(root, exist_ok=True)
    control = os.path.join(root, CONTROL)
    if os.path.islink(root) or os.path.islink(control):
        raise RuntimeError(f"refusing a run dir that is a symlink: {root}")
    for token_file in (os.path.join(control, "token"), os.path.join(root, "token")):
        if os.path.lexists(token_file) and _read_small(token_file) != token:
            raise RuntimeError(f"run dir in use by another run: {root}")
    started = find(root)  # the run dir is this run's (claimed before its patches, or a retried launch)
    if started is not None:
        return {**started, "again": True}
    os.makedirs(control, exist_ok=True)
    if _read_small(os.path.join(control, "token")) is None:  # readable by all: other users' leases check it
        _write(os.path.join(control, "token"), token, 0o644)
    _write(os.path.join(control, "wrapper.sh"), wrapper, 0o644)
    _write(os.path.join(root, "job.sh"), script, 0o644)
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        subprocess.Popen(["bash", f"./{CONTROL}/wrapper.sh"], cwd=root, stdin=devnull, stdout=devnull,
                         stderr=devnull, start_new_session=True, close_fds=True)
    finally:
        os.close(devnull)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = _read_small(os.path.join(control, "pid"))
        if text and len(text.split()) == 2:
            pid, start = text.split()
            return {"pid": int(pid), "start": start, "again": False}
        time.sleep(0.02)
    raise RuntimeError("the wrapper wrote no pid within 10 s")


def _write(path, text, mode):
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def find(root):
    """The pid and start time a run dir's wrapper recorded, or None."""
    for path in (os.path.join(root, CONTROL, "pid"), os.path.join(root, "pid")):
        fields = (_read_small(path) or "").split()
        if len(fields) == 2 and fields[0].isdigit():
            return {"pid": int(fields[0]), "start": fields[1]}
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


def tail(path, lines):
    """The last `lines` lines of a file, read from its end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        block, data = 64 << 10, b""
        pos = size
        while pos > 0 and data.count(b"\n") <= lines:
            pos = max(0, pos - block)
            data = os.pread(fd, size - pos, pos)
        return b"\n".join(data.split(b"\n")[-lines - 1:]).decode(errors="replace") if lines > 0 else ""
    finally:
        os.close(fd)


def health(url, timeout):
    """The HTTP status of a server's endpoint, asked on this host; None when nothing answered."""
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
        self.last = None  # what the last push said of the job
        self.group_seen = 0.0
        self.group_alive = False
        self.wanted = True  # push at the next tick even without news (a new follow, a poke)
        self.seen = None  # (size, inode) of the log at the last tick: unchanged, nothing to check

    @property
    def log(self):
        return os.path.join(self.root, "log")

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
        if (size, ino) == self.seen and ino == self.inode:
            return self.log, False
        self.seen = (size, ino)
        if self.inode is not None and ino is not None and ino != self.inode:
            old = _by_inode(self.root, self.inode)
            if old is not None:
                osize = _size(old)
                if size == 0:  # renamed away, the wrapper still writes to the old file
                    return old, False
                if osize > self.offset:
                    self.src = old
                    return old, True
            self.offset, self.tail, self.inode = 0, b"", ino
            return self.log, False
        if size < self.offset or not self._same(self.log, self.offset):
            copy = self.log + ".1"  # copytruncate: the rest is in the copy
            if _size(copy) > self.offset and self._same(copy, self.offset):
                self.src = copy
                return copy, True
            self.offset, self.tail = 0, b""
        self.inode = ino
        return self.log, False

    def state(self, now):
        """What changed since the last push, or None when nothing did and nothing was asked."""
        alive, wrapper = self.alive(now)
        control = control_dir(self.root)
        exit_code = _int(_read_small(os.path.join(control, "exit_code")))
        node = _node(_read_small(os.path.join(control, "node"), 200))  # a batch job's, noted on its node
        present = os.path.isdir(self.root)
        try:
            st = os.stat(self.log)
            size, ino = st.st_size, st.st_ino
        except OSError:
            size, ino = 0, None
        path, rotated = self._choose(size, ino)
        if path != self.log:
            size = _size(path)
        data = _pread(path, self.offset, min(CHUNK, max(0, size - self.offset)))
        brief = (alive, wrapper, exit_code, present, node)
        if not data and brief == self.last and not self.wanted and not rotated:
            return None
        self.wanted = False
        self.last = brief
        doc = {"push": "state", "key": self.key, "alive": alive, "wrapper": wrapper, "exit_code": exit_code,
               "size": size, "offset": self.offset, "data": base64.b64encode(data).decode(),
               "run_dir": present, "inode": self.inode if path == self.log else _ino(path), "node": node,
               "rotated": rotated,
               "started_at": _number(_read_small(os.path.join(control, "started_at"))),
               "ended_at": _number(_read_small(os.path.join(control, "ended_at")))}
        self.offset += len(data)
        self.tail = (self.tail + data)[-TAIL_MARK:]
        if rotated and self.offset >= size:  # the rest of the old file is out: the new log from 0
            self.src, self.offset, self.tail, self.inode = None, 0, b"", None
            self.wanted = True
        elif self.offset < size:
            self.wanted = True  # more of a backlog at the next tick
        return doc


def _node(text):
    """A node name as the batch script noted it, with anything a node name cannot hold dropped."""
    name = "".join(c for c in (text or "") if c.isalnum() or c in "_.-")
    return name or None


def _size(path):
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _ino(path):
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _pread(path, offset, length):
    if length <= 0:
        return b""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return b""
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _by_inode(root, inode):
    try:
        for entry in os.scandir(root):
            if entry.is_file(follow_symlinks=False) and entry.inode() == inode:
                return entry.path
    except OSError:
        pass
    return None


# -- the loop -------------------------------------------------------------------------------------------
class Agent:
    def __init__(self):
        self.followed = {}
        self.lock = threading.Lock()

    def hello(self, req):
        with open(__file__, "rb") as f:  # the bootstrap checked these bytes before it ran them
            digest = hashlib.sha256(f.read()).hexdigest()
        boot = _read_small("/proc/sys/kernel/random/boot_id")
        u = os.uname()
        return {"sha256": digest, "pid": os.getpid(), "boot_id": boot, "time": time.time(),
                "python": sys.version.split()[0], "uname": f"{u.sysname} {u.release} {u.machine}"}

    def follow(self, req):
        with self.lock:
            self.followed[str(req["key"])] = Followed(req)
        return {}

    def unfollow(self, req):
        with self.lock:
            self.followed.pop(str(req["key"]), None)
        return {}

    def poke(self, req):
        with self.lock:
            for key in req.get("keys") or []:
                if str(key) in self.followed:
                    self.followed[str(key)].wanted = True
        return {}

    def ping(self, req):
        return {}

    def launch(self, req):
        return launch(req["dir"], req["script"], req["wrapper"], req["token"])

    def kill(self, req):
        return {"outcome": kill(req["pid"], req["start"], req.get("grace_s", 10))}

    def find(self, req):
        return {"job": find(req["dir"])}

    def loss(self, req):
        return {"reason": explain_loss(req["dir"], req.get("start", ""))}

    def tail(self, req):
        return {"text": tail(req["path"], int(req["lines"]))}

    def health(self, req):
        return {"code": health(req["url"], float(req.get("timeout", 5)))}

    SLOW = ("launch", "kill", "loss", "health", "tail", "find")  # answered from a thread: pushes go on

    def handle(self, line):
        try:
            req = json.loads(line)
            op = req["op"]
            fn = getattr(self, op) if op in OPS else None
        except (ValueError, KeyError, TypeError):
            send({"id": None, "ok": False, "error": f"not a request: {line[:200]!r}"})
            return
        if fn is None:
            send({"id": req.get("id"), "ok": False, "error": f"unknown op: {op!r}"})
            return
        if op in self.SLOW:
            threading.Thread(target=self.answer, args=(fn, req), daemon=True).start()
        else:
            self.answer(fn, req)

    def answer(self, fn, req):
        try:
            send({"id": req.get("id"), "ok": True, "result": fn(req)})
        except Exception as exc:  # noqa: BLE001 - an op's failure is its reply; the agent goes on
            send({"id": req.get("id"), "ok": False, "error": str(exc) or type(exc).__name__})

    def tick(self):
        now = time.monotonic()
        with self.lock:
            runs = list(self.followed.values())
        for run in runs:
            try:
                doc = run.state(now)
            except Exception as exc:  # noqa: BLE001 - one run's trouble (a vanished dir) is that run's, not the agent's
                doc = {"push": "trouble", "key": run.key, "error": str(exc)}
            if doc is not None:
                send(doc)

    def serve(self):
        sel = selectors.DefaultSelector()
        sel.register(0, selectors.EVENT_READ)
        buf = b""
        heard = beat = time.monotonic()
        while True:
            if sel.select(TICK_S):
                chunk = os.read(0, 1 << 16)
                if not chunk:
                    return  # the watcher closed the channel
                heard = time.monotonic()
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        self.handle(line.decode(errors="replace"))
            self.tick()
            now = time.monotonic()
            if now - beat >= BEAT_S:
                beat = now
                send({"push": "beat", "time": time.time()})
            if now - heard > IDLE_EXIT_S:
                return


OPS = ("hello", "follow", "unfollow", "poke", "ping", "launch", "kill", "find", "loss", "tail", "health")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # the channel gone: end quietly
    try:
        Agent().serve()
    except (BrokenPipeError, KeyboardInterrupt):
        pass
