"""The agent's protocol: one agent per watcher connection, speaking JSON lines, its ops dispatched here.

orch places this package in the host's workdir as one archive under its content hash (boot.py) and starts it
over one SSH channel (or as a child process on this machine). Requests come on stdin, one JSON object a line:
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

Leases are ops of the agent too (leases.py): no process is started on the host to take, look at or
release them. Runs on the host's python (3.8 or newer): no annotations evaluated, no third-party imports.
"""

import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time

from . import leases
from .checks import MAX_READ, OPS, checked
from .common import CHUNK, _read_small
from .files import (
    file_size,
    files_under,
    health,
    list_dir,
    path_stat,
    read_chunk,
    run_argv,
    run_program,
    tail,
    usage,
)
from .following import FollowedLog, _patterns, hold
from .gpus import GpuError, gpus, host_facts
from .jobs import launch, own_digest
from .procs import kill, kill_pids, stacks
from .rundirs import explain_loss, find, job_id_of
from .slurm import sacct, scancel, sinfo, squeue, submit

TICK_S = 0.05  # how often followed logs and jobs are looked at; a push batches the bytes of one tick
BEAT_S = 2.0
IDLE_EXIT_S = 60.0  # the watcher pings every few seconds; this long without a word, it is gone

WINDOW = 8 << 20  # pushed log bytes not yet acknowledged by the watcher, at most

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
            old, self.followed[a["key"]] = self.followed.get(a["key"]), FollowedLog(a)
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
        f = FollowedLog({**a, "key": "read"})
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
        return run_program(a["python"], a["path"], a["sha256"], a["entry"], a["input"], a["pythonpath"],
                           float(a["timeout_s"]))

    def lease(self, a):
        """Take, renew, release or look at the host's lease files, here in the agent (leases.py)."""
        return leases.answer(a)

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
            "program", "lease")

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
