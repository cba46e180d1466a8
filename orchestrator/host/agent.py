"""orch's end of a host agent (the `hostjobs` package): placed on the host, started over one channel, spoken
to in JSON lines.

The agent is the host side's archive (hostprogram.py): named by its content hash under the host's
workdir, uploaded once per version, and started through the bootstrap that imports only the bytes whose
sha256 it checked — a file someone else swapped there is uploaded again, never run. One reader thread takes the
agent's lines apart: replies go to the request that waits for them, pushes (a run's new log bytes, its
end, a heartbeat) into `pushes`. A message with file bytes names their count in `bytes`; they follow its
line raw and land in its `data` (see hostjobs/protocol.py). The agent pushes at most its window of log bytes
ahead of `ack`: whoever takes pushes acknowledges them once done, which bounds what waits in `pushes`
while the reader never stops reading (a reply never waits behind a full queue). A link that stays
silent past SILENT_S (the agent beats every 2 s) is closed: `alive` turns False and whoever holds the
link makes a new one.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import HostError, RemoteError, Unreachable
from . import hostprogram, session
from .remote import LocalTransport, Transport, quote
from .transport import Stream

SILENT_S = 15.0  # no line from the agent for this long (it beats every 2 s): the link went dark
PING_S = 5.0  # the agent exits after a minute without a word from us
IDLE_CLOSE_S = 30.0  # a shared link with no request for this long is closed; the next request starts one


def source() -> bytes:
    """The host side's archive, as it is placed on a host."""
    return hostprogram.archive()


def digest() -> str:
    return hostprogram.digest()


def from_sources(transport: Transport) -> bool:
    """On this machine the agent runs from orch's own sources: nothing is placed in the workspace (`orch
    gpus` in any folder creates nothing there), except for a batch scheduler, whose nodes reach the agent's
    wrapper only through the workdir."""
    return isinstance(transport, LocalTransport) and transport.host.scheduler is None


def remote_path(transport: Transport) -> str:
    """Where the agent runs from: the placed archive, or (from_sources) orch's own package folder."""
    return hostprogram.TOP if from_sources(transport) else hostprogram.remote_path(transport)


def bootstrap(transport: Transport) -> str:
    """The one shell line that starts the agent: the host's python imports the checked bytes of the archive."""
    if from_sources(transport):
        program, args = hostprogram.SOURCES_RUN, [hostprogram.TOP]
    else:
        program, args = hostprogram.BOOTSTRAP, [remote_path(transport), digest()]
    # isolated (-I): no PYTHON* variable, user site or current folder decides what the agent imports
    return " ".join(["exec", quote(transport.host.python), "-I", "-u", "-c", *map(quote, [program, *args])])


class AgentError(RemoteError):
    """An op the agent refused or failed, in its own words."""

    def __init__(self, host: str, op: str, message: str):
        super().__init__(host, f"agent {op}", None, "", reason=message)
        self.message = message


@dataclass
class Push:
    kind: str  # state | beat | trouble | closed
    key: str | None = None
    doc: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """The log bytes it carries, as counted against the agent's window."""
        return len(data_of(self.doc))


class AgentLink:
    """One running agent on a host, over one channel of the host's connection."""

    def __init__(self, transport: Transport, stream: Stream, idle_close_s: float | None = None):
        self.transport = transport
        # a link of requests only (shared): the agent's heartbeats are not kept, and it closes when idle
        self.idle_close_s = idle_close_s
        self._busy = 0
        self.used = time.monotonic()
        self.host = transport.host.name
        self._stream = stream
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[threading.Event, list[dict[str, Any]]]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.pushes: queue.Queue[Push] = queue.Queue()
        self.heard = time.monotonic()
        self.alive = True
        self.info: dict[str, Any] = {}
        threading.Thread(target=self._read, name=f"orch-agent-{self.host}", daemon=True).start()
        threading.Thread(target=self._keep, name=f"orch-agent-ping-{self.host}", daemon=True).start()

    @classmethod
    def start(cls, transport: Transport, timeout: float = 60, idle_close_s: float | None = None) -> AgentLink:
        """Place the agent when missing, start it, and check at the handshake that it is this version."""
        for attempt in (1, 2):
            link = cls(transport, transport.stream(bootstrap(transport)), idle_close_s)
            try:
                info = link.call("hello", timeout=timeout)
            except (AgentError, Unreachable) as exc:
                link.close()
                if attempt == 2 or from_sources(transport):  # orch's own sources are never placed
                    raise _why_not(transport, exc) from None
                # not there, or not this version (the bootstrap runs nothing else): upload it, once
                hostprogram.upload(transport, remote_path(transport))
                continue
            if info.get("sha256") == digest():
                link.info = info
                return link
            link.close()
        raise Unreachable(transport.host.name, f"the agent at {remote_path(transport)} is not this orch's")

    # requests ---------------------------------------------------------------------------------------
    def call(self, op: str, timeout: float = 60, **args: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raises AgentError for a refusal, Unreachable when the
        link ends or the reply does not come in time."""
        rid = next(self._ids)
        done, box = threading.Event(), list[dict[str, Any]]()
        with self._lock:
            if not self.alive:
                raise Unreachable(self.host, "the agent's channel is closed")
            self._waiting[rid] = (done, box)
            self._busy += 1
        try:
            self._send({"id": rid, "op": op, **args})
            if not done.wait(timeout):
                raise Unreachable(self.host, f"the agent gave no answer to {op} within {timeout:g} s")
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
                self._busy -= 1
                self.used = time.monotonic()
        reply = box[0]
        if reply.get("closed"):
            raise Unreachable(self.host, "the agent's channel closed before it answered")
        if not reply.get("ok"):
            raise AgentError(self.host, op, str(reply.get("error")))
        result: dict[str, Any] = reply.get("result") or {}
        return result

    def tell(self, op: str, **args: Any) -> None:
        """A request whose reply nobody waits for (follow, poke): sent, its answer dropped."""
        self._send({"id": None, "op": op, **args})

    def ack(self, size: int) -> None:
        """Done with `size` bytes of pushed log: the agent may push as many more."""
        if size > 0 and self.alive:
            try:
                self.tell("ack", bytes=size)
            except Unreachable:
                pass  # the link's end is a push of its own

    def _send(self, doc: dict[str, Any]) -> None:
        data = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
        try:
            with self._send_lock:
                self._stream.send(data)
        except EOFError as exc:
            self._end()
            raise Unreachable(self.host, f"the agent's channel is closed: {exc}") from None

    # the reader ---------------------------------------------------------------------------------------
    def _read(self) -> None:
        buf = bytearray()
        head: dict[str, Any] | None = None  # a message whose raw bytes are still coming
        want = 0
        while True:
            chunk = self._stream.recv(1 << 20)
            if not chunk:
                break
            self.heard = time.monotonic()
            buf += chunk
            at = 0
            while True:
                if head is not None:
                    if len(buf) - at < want:
                        break
                    with memoryview(buf) as view:
                        data = bytes(view[at:at + want])
                    at += want
                    self._dispatch(head, data)
                    head = None
                    continue
                end = buf.find(b"\n", at)
                if end < 0:
                    break
                doc = _message(bytes(buf[at:end]))
                at = end + 1
                if doc is None:
                    continue
                size = doc.get("bytes")
                if isinstance(size, int) and not isinstance(size, bool) and size > 0:
                    head, want = doc, size
                else:
                    self._dispatch(doc, b"")
            del buf[:at]
        self._end()

    def _dispatch(self, doc: dict[str, Any], data: bytes) -> None:
        if "bytes" in doc:
            result = doc.get("result")
            (result if isinstance(result, dict) else doc)["data"] = data
        if "push" in doc:
            if self.idle_close_s is None:
                self.pushes.put(Push(str(doc["push"]), doc.get("key"), doc))
            return
        rid = doc.get("id")
        with self._lock:
            waiter = self._waiting.get(rid) if isinstance(rid, int) else None
        if waiter is not None:
            waiter[1].append(doc)
            waiter[0].set()

    def _keep(self) -> None:
        """Ping the agent (it exits after a minute without a word) and close a link gone silent."""
        pinged = time.monotonic()
        while self.alive:
            time.sleep(1.0)
            now = time.monotonic()
            if now - self.heard > SILENT_S:
                self.close()
                return
            if self.idle_close_s is not None and not self._busy and now - self.used > self.idle_close_s:
                self.close()
                return
            if now - pinged >= PING_S:
                pinged = now
                try:
                    self.tell("ping")
                except Unreachable:
                    return

    def _end(self) -> None:
        with self._lock:
            if not self.alive:
                return
            self.alive = False
            waiting = list(self._waiting.values())
        for done, box in waiting:
            box.append({"closed": True})
            done.set()
        self.pushes.put(Push("closed"))

    def close(self) -> None:
        self._end()
        self._stream.close()


_shared_lock = threading.Lock()


def shared(transport: Transport) -> AgentLink:
    """The one link of requests to the host's agent for this process (one-shot commands, GPU snapshots,
    health checks): started at its first request, closed once idle. A host whose python cannot run the
    agent raises a one-line HostError."""
    held_now = session.current()  # one start at a time per host; hosts start in parallel
    with _shared_lock:
        starting = held_now.agent_starts.setdefault(id(transport), threading.Lock())
    with starting:
        held = held_now.agent_links.get(id(transport))
        if held is not None and held[0] is transport and held[1].alive:
            held[1].used = time.monotonic()  # handed out: not closed as idle before its request
            return held[1]
        link = AgentLink.start(transport, idle_close_s=IDLE_CLOSE_S)
        with _shared_lock:
            held_now.agent_links[id(transport)] = (transport, link)
        return link


def call(transport: Transport, op: str, timeout: float = 60, **args: Any) -> dict[str, Any]:
    """One request to the host's agent over the shared link."""
    return shared(transport).call(op, timeout=timeout, **args)


def program(transport: Transport, entry: str, request: dict[str, Any], *, python: str | None = None,
            pythonpath: str | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Run an entry of the host side's archive (hostprogram.py) that needs a python of its own (the patcher,
    under the run's python) with `request`, through the host's agent: its `program` op starts `python`
    (default: the host's) on the bootstrap, which imports the placed archive only when its sha256 is this
    version's, the request on its stdin; no shell. The entry's reply (whatever its `ok`). One request in the
    usual case; the archive is uploaded when the host lacks this version (or holds a file swapped under its
    name), then asked again."""
    path = hostprogram.remote_path(transport)
    limit = hostprogram.TIMEOUT_S if timeout is None else timeout
    args = {"python": python or transport.host.python, "path": path, "sha256": digest(), "entry": entry,
            "input": json.dumps(request), "pythonpath": pythonpath, "timeout_s": limit}
    what = f"{entry} {request.get('action')}"
    try:
        result = call(transport, "program", timeout=limit + 30, **args)
        if result.get("code") == hostprogram.MISSING and not result.get("stdout"):
            hostprogram.upload(transport, path)
            result = call(transport, "program", timeout=limit + 30, **args)
    except AgentError as exc:  # it did not end in time, or could not be started
        raise RemoteError(transport.host.name, what, None, "", reason=exc.message) from None
    out, err = str(result.get("stdout") or ""), str(result.get("stderr") or "")
    try:
        reply = json.loads(out.strip().splitlines()[-1])
        if not isinstance(reply, dict):
            raise TypeError(reply)
    except (ValueError, TypeError, IndexError):
        raise RemoteError(transport.host.name, what, result.get("code"), out + err,
                          reason=f"the host side's {entry} gave no reply") from None
    return reply


def _why_not(transport: Transport, exc: Exception) -> Exception:
    """Why the agent did not answer: the host's python cannot run it (a one-line error naming it), or
    the host itself went away."""
    python = transport.host.python
    probe = f"{quote(python)} -c 'import sys; assert sys.version_info >= (3, 8), sys.version'"
    try:
        res = transport.run(probe, check=False, timeout=30)
    except Unreachable:
        return exc
    if res.ok:
        return exc
    said = (res.stderr.strip().splitlines() or [f"exit code {res.exit_code}"])[-1]
    return HostError(f"{transport.host.name}: its python cannot run orch's agent: {python}: {said[:200]} "
                     "(python 3.8 or newer is needed; set `python` in hosts.toml)")


def _message(line: bytes) -> dict[str, Any] | None:
    """One of the agent's lines; None for anything else (a login banner, a shell's word)."""
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def data_of(doc: dict[str, Any]) -> bytes:
    """The file bytes a message carried (raw after its line; see `_read`)."""
    data = doc.get("data")
    return data if isinstance(data, bytes) else b""
