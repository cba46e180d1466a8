"""The dry run: a start's own steps against a host that records instead of doing.

The start's host side (starting.open_new, starting.prepare_and_launch: the lease files, patch checks,
GPU cleanup, the playbook's looks and uploads, the launch) runs as it is, over a `RecordingTransport`.
That transport runs nothing: each shell command, upload and request to the host's agent is recorded and
answered as an idle, empty host would answer (no GPU busy, no file there, each of orch's host programs
succeeding), so what the dry run lists is what a start sends, in its order, with no description of its own
to keep in step.
The run, its lease and its events go to a copy of the database in memory (Store.scratch_copy) and vanish.
"""

from __future__ import annotations

import getpass
import json
import os
import queue
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config.hosts import Host
from ..config.spec import RunSpec, masked
from ..config.workspace import Workspace
from ..host import agent, hostlease
from ..host.executor import executor_class
from ..host.remote import Result, Transport, quote
from ..host.transport import Stream
from ..playbook import Playbook
from ..secret_env import masked_env
from ..store import Store, lease
from ..store.lifecycle import transition
from ..store.record import Status
from .context import watch_options
from .nodes import check_nodes, node_env, rendezvous_point
from .starting import HostTake, busy_message, check, launch, open_new, prepare, prepare_and_launch

STAND_IN_PORT = 29500  # the rendezvous port a dry run shows (torchrun's default)
# Requests that keep the agent's link going, not steps of the start.
_LINK_OPS = ("hello", "ping", "ack")


@dataclass(frozen=True)
class Step:
    """One thing a start would send to its host, as it would be sent."""

    host: str
    kind: str  # agent (a request to the host's agent) | command (a shell command) | upload | agent-start
    what: str  # in words, from the request itself
    request: dict[str, Any] = field(default_factory=dict)
    body: str | None = None  # what to show in full: the command, the job script

    def text(self, number: int) -> str:
        by = ", the agent" if self.kind == "agent" else ""
        head = f"# {number}. on {self.host}{by}: {self.what}"
        return head + (f"\n{self.body.rstrip()}" if self.body else "")


class RecordingTransport(Transport):
    """A host that records what it is given and changes nothing: shell commands succeed silently, uploads
    are dropped, and its agent (started through `stream`, as over SSH) answers as an idle, empty host."""

    def __init__(self, host: Host, gpus: list[int] | None = None, steps: list[Step] | None = None):
        self.host = host
        self.gpus = sorted(set(range(host.gpus)) | set(gpus or []))  # what nvidia-smi would list
        self.steps: list[Step] = [] if steps is None else steps  # (the hosts of one run share theirs: in order)
        self._streams: list[_RecordingAgent] = []
        # `~` is not asked of a host: this machine's home, else the usual home of the host's user
        self._home = os.path.expanduser("~") if host.on_this_machine else _usual_home(host.user or getpass.getuser())

    def record(self, kind: str, what: str, request: dict[str, Any], body: str | None = None) -> None:
        self.steps.append(Step(self.host.name, kind, what, request, body))

    def run(self, command: str, *, check: bool = True, timeout: float | None = None,
            idle_timeout: float | None = None) -> Result:
        self.record("command", "run in a shell:", {"command": command}, command)
        return Result(self.host.name, command, 0, "", "")

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None:
        self.record("upload", f"upload {len(data)} bytes to {path} (mode {mode:o})",
                    {"path": path, "bytes": len(data), "mode": mode})

    def stream(self, command: str) -> Stream:
        self.record("agent-start", f"start orch's agent with {self.host.python} (its file run only once its "
                    "sha256 is this orch's)", {"python": self.host.python})
        stream = _RecordingAgent(self)
        self._streams.append(stream)
        return stream

    def close(self) -> None:
        for stream in self._streams:
            stream.close()


def _usual_home(user: str) -> str:
    return "/root" if user == "root" else f"/home/{user}"


class _RecordingAgent(Stream):
    """The host's agent as the recorder plays it: each request recorded, each answered at once."""

    def __init__(self, transport: RecordingTransport):
        self.transport = transport
        self._replies: queue.Queue[bytes] = queue.Queue()

    def send(self, data: bytes) -> None:
        for line in data.decode().splitlines():
            request = json.loads(line)
            op = str(request.get("op"))
            args = {k: v for k, v in request.items() if k not in ("id", "op")}
            if op not in _LINK_OPS:
                what, body = _describe(op, args, self.transport.gpus, self.transport.host.python)
                self.transport.record("agent", what, {"op": op, **args}, body)
            if request.get("id") is not None:
                reply = {"id": request["id"], "ok": True, "result": _answer(self.transport, op, args)}
                self._replies.put((json.dumps(reply) + "\n").encode())

    def recv(self, n: int) -> bytes:
        return self._replies.get()

    def close(self) -> None:
        self._replies.put(b"")  # the reader's end of the link


def _program(args: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Which entry of orch's host side a `program` request runs (a `patch` request: the agent's own
    patcher), and its request."""
    if isinstance(args.get("request"), dict):
        return "patch", args["request"]
    name = str(args.get("entry"))
    try:
        request = json.loads(args.get("input") or "{}")
    except ValueError:
        request = {}
    return name, request if isinstance(request, dict) else {}


def _site(python: str) -> str:
    return f"<site-packages of {python}>"


def _answer(transport: RecordingTransport, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """What an idle, empty host answers: nothing there, every GPU free, every program content."""
    if op == "hello":
        return {"sha256": agent.digest()}
    if op == "gpus":
        if not transport.gpus:
            return {"nvidia_smi": False}
        rows = [{"index": str(i), "uuid": f"GPU-{i}", "memory.used": "0", "memory.total": "",
                 "utilization.gpu": "0"} for i in transport.gpus]
        return {"nvidia_smi": True, "gpus": rows, "apps": [], "procs": {}}
    if op == "exec":
        return {"code": 0, "stdout": "", "stderr": ""}
    if op == "launch":
        return {"pid": 0, "start": "0"}
    if op == "submit":
        return {"job_id": 0}
    if op == "port":
        return {"port": STAND_IN_PORT}
    if op in ("listdir", "usage", "find"):
        return {"entries": None, "usage": None, "job": None, "job_id": None}
    if op in ("tail", "size"):
        return {"text": "", "size": 0}
    if op == "lease":
        return {"ok": True, "warnings": []}
    if op in ("program", "patch"):
        name, request = _program(args)
        reply: dict[str, Any] = {"ok": True, "warnings": []}
        if name == "patch" and request.get("action") in ("check", "apply"):
            root = request.get("within") or _site(str(args.get("python") or transport.host.python))
            state = "pristine" if request["action"] == "check" else "applied"
            reply.update(package=request.get("package"), version=None, root=root, set_hash=request.get("set_hash"),
                         files=[{"file": f, "path": f"{root}/{f}", "sha_before": "", "sha_after": "", "state": state}
                                for f in request.get("files") or {}])
        return reply if op == "patch" else {"code": 0, "stdout": json.dumps(reply), "stderr": ""}
    return {}  # stat: nothing there; chunk: no bytes


def _describe(op: str, args: dict[str, Any], gpus: list[int], python: str) -> tuple[str, str | None]:
    """A request to the agent in words (`gpus`: those the answer lists; `python`: the one the agent runs on),
    and what of it to show in full."""
    path = args.get("path") or args.get("dir")
    if op == "launch":
        what = (f"write job.sh into {args['dir']} and start it under the agent's wrapper as a session leader "
                "(setsid): its pid and start time name the job")
        return what, str(args["script"])
    if op == "submit":
        options = " ".join(quote(str(o)) for o in args.get("options") or [])
        return f"write job.sh into {args['dir']} and submit it: sbatch {options}", str(args["script"])
    if op in ("program", "patch"):
        return _describe_program({"python": python, **args}), None
    if op == "lease":
        return _describe_lease(args), None
    if op == "gpus":
        if not gpus:
            return "look at what holds the GPUs (nvidia-smi): answered as a host without GPUs", None
        listed = ",".join(map(str, gpus))
        return f"look at what holds GPUs {listed} (nvidia-smi, /proc): answered as free, so nothing is stopped", None
    if op == "exec":
        return "run without a shell: " + " ".join(quote(str(a)) for a in args.get("argv") or []), None
    words = {"stat": "look at what is at", "listdir": "list", "usage": "count what is in", "chunk": "read",
             "size": "read the size of", "tail": "read the last lines of", "find": "look for the job recorded in"}
    if op in words and path:
        return f"{words[op]} {path} (answered: nothing there)", None
    shown = {k: v for k, v in args.items() if not isinstance(v, str) or len(v) < 200}
    return f"{op} {json.dumps(shown, sort_keys=True)}", None


def _describe_lease(request: dict[str, Any]) -> str:
    action = request.get("action")
    keys = ", ".join(request.get("keys") or [])
    leases = f"{request.get('workdir')}/{hostlease.DIR}/"
    if action == "take":
        took = f" and take the lease files {keys} in {leases}" if keys else ""
        return f"make {request.get('run_dir')} the run's own (its token){took}"
    return f"lease {action} in {leases}"


def _describe_program(args: dict[str, Any]) -> str:
    name, request = _program(args)
    action = request.get("action")
    python = str(args.get("python"))
    if name == "patch" and action in ("check", "apply"):
        files = ", ".join(request.get("files") or {})
        target = (f"the run's copy of {request.get('package')} in {request['within']}" if request.get("within")
                  else f"{request.get('package')} {request.get('versions') or ''} of {python}".replace("  ", " "))
        if action == "check":
            return f"check that patch set {request.get('set_name')} applies to {target} ({files}); nothing written"
        return f"apply patch set {request.get('set_name')} to {target} ({files}), keeping the originals"
    return f"run orch's host side {name} ({action}) with {python}"


@dataclass
class DryRun:
    """What a start would do on its host, in order, and what stands in the way now (`notes`)."""

    playbook: str
    host: str
    run_id: int  # the id the run would get
    steps: list[Step]
    notes: list[str] = field(default_factory=list)

    @property
    def script(self) -> str | None:
        """The job script the launch would start."""
        launched = [s for s in self.steps if s.request.get("op") in ("launch", "submit")]
        return str(launched[-1].request["script"]) if launched else None

    def text(self) -> str:
        head = (f"# dry run: {self.playbook} on {self.host} as run {self.run_id}; nothing was created or sent. "
                "The host's answers are stand-ins: no GPU busy, no file there.")
        lines = [head]
        lines += [f"# note: {n}" for n in self.notes]
        lines += [s.text(i) for i, s in enumerate(self.steps, 1)]
        return "\n".join(lines) + "\n"

    def document(self) -> dict[str, Any]:
        return {"dry_run": True, "playbook": self.playbook, "host": self.host, "run_id": self.run_id,
                "notes": self.notes, "steps": [asdict(s) for s in self.steps]}


def dry_run(ws: Workspace, store: Store, pb: Playbook[Any], spec: RunSpec, hosts: list[Host]) -> DryRun:
    """What starting this run would do on its hosts (the first is the head of a run across several), from
    the start's own steps; nothing is created, in the database or on any host. Bad input is refused as a
    start refuses it."""
    # what it shows holds each secret as the record would, the hosts' `env` as the spec's: masked
    spec = masked(spec)
    hosts = [h.model_copy(update={"env": masked_env(h.env, [*h.secret_env, *spec.secret_env])}) for h in hosts]
    if len(hosts) > 1:
        check_nodes(pb, spec, hosts)
    for host in hosts:
        check(store, pb, spec, host)
    steps: list[Step] = []
    recorders = {h.name: RecordingTransport(h, spec.gpus, steps) for h in hosts}
    scratch = store.scratch_copy()
    notes: list[str] = []
    try:
        by_name = sorted(hosts, key=lambda h: h.name)

        def create() -> list[int]:
            ids = {h.name: scratch.create_run(pb.name, h.name, spec.model_dump(mode="json")) for h in hosts}
            return [ids[h.name] for h in by_name]

        # as `start`: the hosts' lease files taken (answered by the recorders), unless the scheduler places the job
        claim = HostTake(ws, scratch, by_name, recorders, spec.gpus)
        if pb.exclusive and not executor_class(hosts[0]).schedules_gpus:
            opts = watch_options(pb, spec, hosts[0])
            # the hosts are not asked: what they last granted this workspace says whether a start would wait
            busy = lease.granted_holder(scratch, [h.name for h in by_name], spec.gpus)
            if busy is not None:
                notes.append(f"a start now would not go ahead: {busy_message(scratch, busy)}")
            ids = claim.made(lambda: lease.acquire_all(scratch, [h.name for h in by_name], spec.gpus, create,
                                                       opts.poll_max, probe=lambda _: None, claim=claim))
        else:
            with scratch.tx():
                ids = create()
        run_of = dict(zip([h.name for h in by_name], ids, strict=True))
        for host in hosts:
            transition(scratch, run_of[host.name], Status.PREPARING)
            if host.workdir.startswith("~") and not host.on_this_machine:
                notes.append(f"~ in the workdir of {host.name} is taken as {recorders[host.name].home()}: the host "
                             "was not asked")
        jobs = {h.name: open_new(ws, scratch, pb, spec, h, recorders[h.name], run_of[h.name], dry_run=True)
                for h in by_name}
        if len(hosts) == 1:
            prepare_and_launch(jobs[hosts[0].name], claim.taken.get(run_of[hosts[0].name]))
        else:
            notes.append(f"MASTER_PORT {STAND_IN_PORT} stands in for the port the head's agent finds free at launch")
            scripts = {name: prepare(job, claim.taken.get(run_of[name])) for name, job in jobs.items()}
            address, port = rendezvous_point(jobs[hosts[0].name])
            for rank, host in enumerate(hosts):
                env = node_env(rank, len(hosts), host, address, port)
                launch(jobs[host.name], scripts[host.name](env))
    finally:
        for recorder in recorders.values():
            recorder.close()
        scratch.close()
    return DryRun(pb.name, ", ".join(h.name for h in hosts), run_of[hosts[0].name], steps, notes)
