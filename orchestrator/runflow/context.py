"""A run's job as the run flow acts on it: opened from its record, with its playbook, spec, host, paths and
backend."""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config.hosts import Host, Inventory
from ..config.spec import RunSpec, stored
from ..config.workspace import Workspace
from ..errors import HostError, OrchError, Unreachable
from ..host import agent
from ..host.executor import Executor, executor_for
from ..host.health import HealthCheck
from ..host.hostlease import run_paths
from ..host.launch import RunPaths
from ..host.polling import follow_log_s, poll_bounds
from ..host.remote import DEFAULT_TIMEOUT_S, Result, Transport, connect, quote
from ..playbook import Entry, Playbook, RunContext, Usage
from ..store import Store, runtables
from ..store.lease import BEFORE_RELEASE
from ..store.record import RunRecord
from . import registry
from .watching import WatchLock

if TYPE_CHECKING:
    from ..store.runtables import RunTables

@dataclass
class WatchOptions:
    """How a run is watched: its poll bounds, what its log says when it is ready or stalled, what is done then."""

    poll_min: float
    poll_max: float
    until_ready: bool = False
    ready_pattern: str | None = None
    engine: str | None = None
    stall_factor: float = 5.0
    on_stall: str = "warn"  # warn | kill | dump
    health: HealthCheck | None = None  # a server's endpoint, asked while it is ready; see host/health.py
    give_up_s: float | None = None  # a host silent for this long: the run ends lost
    tables: Sequence[RunTables] = ()  # plugins' tables: their readers read the log, the rows go to them
    max_failed_fraction: float = 0.0  # a benchmark's requests that may fail before the run does (a share)
    benchmark: bool = False  # a benchmark: no request completed makes its numbers invalid



LOG_TAIL_LINES = 200
# The end steps in their order: the lease is freed right after BEFORE_RELEASE (see store/lease.py); the
# others may run while the host's next run starts.
END_STEPS = (*BEFORE_RELEASE, "outputs", "log tail", "notify")


@dataclass
class Run:
    """A live run, the one object the run flow acts on: its identity (its id and record), playbook and spec,
    host, paths (RunPaths) and backend (its executor, which its record's JobRef names the job to),
    and its state: the record as last read, read again by `refresh` — a store that others write (watchers,
    a `stop` elsewhere) is asked when the flow needs its word, not at every look."""

    ws: Workspace
    store: Store
    pb: Playbook[Any]
    host: Host
    transport: Transport
    executor: Executor
    run_id: int
    spec: RunSpec
    paths: RunPaths
    lock: WatchLock | None = None  # this process watches the run (see watching.py)
    dry_run: bool = False  # its transport records what it is given and answers as an idle, empty host
    last_read: RunRecord | None = field(default=None, repr=False)  # None until first needed
    receipt: dict[str, Any] = field(default_factory=dict, repr=False)  # begun before launch (receipt.py)

    @property
    def record(self) -> RunRecord:
        """The run's record as last read (read now when it never was; a dry run's is in its scratch copy)."""
        return self.last_read if self.last_read is not None else self.refresh()

    def refresh(self) -> RunRecord:
        """Read the run's record again: what the flow decides next depends on what others wrote since."""
        self.last_read = self.store.get_run(self.run_id)
        return self.last_read

    @property
    def holds_host(self) -> bool:
        """Does the run hold its host (or GPU set) while it runs? A client of a server does not, nor a job the
        scheduler places."""
        return self.pb.exclusive and not self.executor.schedules_gpus

    def event(self, kind: str, message: str, data: Any = None) -> None:
        self.store.add_event(self.run_id, kind, message, data)

    def release(self) -> None:
        """Stop being the run's watcher (a detach): a background watcher may take over."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def for_playbook(self) -> RunContext[Any]:
        """The playbook's view of the run."""
        return RunContext(self.run_id, self.spec, self.host, self.paths, RunRemote(self.transport, self.paths.root),
                          self.store.get_run, lambda kind, message: self.event(kind, message), self.dry_run)


class RunRemote:
    """playbook.Remote: commands and uploads through the host's transport; looks at files and argv
    commands through its agent, so a playbook's checks hold no shell."""

    def __init__(self, transport: Transport, root: str):
        self.transport, self.root = transport, root
        self.host = transport.host.name

    def run(self, command: str, *, check: bool = True, timeout: float | None = None) -> Result:
        return self.transport.run(command, check=check, timeout=timeout)

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None:
        self.transport.put(data, path, mode)

    def _at(self, path: str) -> str:
        # the agent takes absolute paths only; a relative one means what it means to the job, in its run dir
        return posixpath.join(self.root, path)

    def _ask(self, op: str, timeout: float = 60, **args: Any) -> dict[str, Any]:
        return agent.call(self.transport, op, timeout=timeout, **args)

    def _stat(self, path: str) -> dict[str, Any]:
        return self._ask("stat", path=self._at(path))

    def exists(self, path: str) -> bool:
        return self._stat(path).get("to") is not None

    def is_file(self, path: str) -> bool:
        return self._stat(path).get("to") == "file"

    def is_dir(self, path: str) -> bool:
        return self._stat(path).get("to") == "dir"

    def list_dir(self, path: str) -> list[Entry] | None:
        got = self._ask("listdir", timeout=300, path=self._at(path)).get("entries")
        return None if got is None else [Entry(str(name), str(kind), int(size)) for name, kind, size in got]

    def usage(self, path: str) -> Usage | None:
        got = self._ask("usage", timeout=300, path=self._at(path)).get("usage")
        return None if got is None else Usage(int(got["entries"]), int(got["bytes"]), int(got["kib"]))

    def read_text(self, path: str, limit: int = 1 << 20) -> str | None:
        found = self._stat(path)
        if found.get("kind") != "file":  # a symlink is not read through, as the agent's other reads
            return None
        data = b""
        while len(data) < limit:  # the agent answers at most a MiB at a time
            got = agent.data_of(agent.call(self.transport, "chunk", timeout=300, path=self._at(path),
                                           offset=len(data), length=limit - len(data)))
            if not got:
                break
            data += got
        return data.decode(errors="replace")

    def run_argv(self, argv: list[str], *, check: bool = True, timeout: float | None = None) -> Result:
        shown = " ".join(quote(a) for a in argv)
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        got = self._ask("exec", timeout=timeout + 30, argv=list(argv), timeout_s=timeout)
        result = Result(self.host, shown, int(got["code"]), str(got["stdout"]), str(got["stderr"]))
        return result.check() if check else result


Hosts = Inventory | Mapping[str, Host]


def _host(ws: Workspace, name: str, hosts: Hosts | None) -> Host:
    if isinstance(hosts, Inventory):
        return hosts.get(name)
    if hosts is not None and name in hosts:
        return hosts[name]
    return Inventory.load(ws.hosts_file, ws.root).get(name)


def open_run(ws: Workspace, store: Store, run: RunRecord | int, hosts: Hosts | None = None,
             any_spec: bool = False) -> Run:
    """The one way to act on an existing run: its playbook, spec, host and paths from its record.

    A stored spec that is damaged or no longer validates is an error naming the run; with `any_spec`
    the run is opened with the default spec instead (and a run whose playbook is no longer installed as a
    plain command), enough to watch, settle or stop its job.
    """
    record = store.get_run(run) if isinstance(run, int) else run
    try:
        pb = registry.playbook(record.playbook)
    except OrchError:
        if not any_spec:
            raise
        # its plugin is gone: as a plain command it can still be watched, settled or stopped
        pb = registry.playbook("command")
    try:
        spec: RunSpec = stored(pb.Spec, record.id, record.spec, "spec" not in record.unreadable)
    except OrchError:
        if not any_spec:
            raise
        spec = RunSpec()
    host = _host(ws, record.host, hosts)
    transport = connect(host)
    root = record.remote_dir or run_paths(ws, transport.expand(host.workdir), record.id).root
    return Run(ws, store, pb, host, transport, executor_for(host, transport), record.id, spec, RunPaths(root),
               last_read=record)


def watch_options(pb: Playbook[Any], spec: RunSpec, host: Host, until_ready: bool = False) -> WatchOptions:
    lo, hi = poll_bounds(host, spec.poll_min, spec.poll_max)
    return WatchOptions(
        poll_min=lo,
        poll_max=hi,
        until_ready=until_ready,
        ready_pattern=pb.ready_pattern(spec),
        engine=pb.log_engine(spec),
        stall_factor=spec.stall_factor,
        on_stall=spec.on_stall,
        health=pb.health(spec, host),
        give_up_s=host.unreachable_give_up_s,
        tables=runtables.installed(),  # one that does not load is told by `orch status ID`
        max_failed_fraction=failed_bound(spec),
        benchmark=any(hasattr(h, "max_failed_fraction") for h in (spec, getattr(spec, "bench", None))),
    )


def failed_bound(spec: RunSpec) -> float:
    """The share of a benchmark's requests that may fail: the spec's `max_failed_fraction` (or its `bench`
    table's), else none may."""
    for holder in (spec, getattr(spec, "bench", None)):
        value = getattr(holder, "max_failed_fraction", None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0


@dataclass
class LogText:
    text: str
    fallback: str | None = None  # why the text is the local copy, not the host's log
    end: int | None = None  # the byte of the host's log the text ends at: following goes on from there


def tail_with_end(run: Run, lines: int) -> LogText:
    """The last lines of the log up to its size at one moment, and that size: in one call, so a follow
    that starts there neither repeats nor drops a line printed meanwhile."""
    got = agent.call(run.transport, "tail", path=run.paths.log, lines=lines)
    size = got.get("size")
    return LogText(str(got["text"]), end=size if isinstance(size, int) else None)


def read_log(ws: Workspace, store: Store, run_id: int, lines: int, hosts: Hosts | None = None) -> LogText:
    """The last lines of a run's log from its host or, when the host cannot be reached (or is no longer in
    the inventory), from the tail fetched when the run ended."""
    run = store.get_run(run_id)
    if not run.remote_dir:
        raise OrchError(f"run {run.id} has no log: it never reached its host ({run.status}"
                        + (f": {run.reason})" if run.reason else ")"))
    local = ws.runs_dir / str(run.id) / "log.tail"
    try:
        return tail_with_end(open_run(ws, store, run, hosts, any_spec=True), lines)
    except (Unreachable, HostError) as exc:
        if not local.is_file():
            raise
        kept = local.read_text(errors="replace").splitlines(keepends=True)[-lines:] if lines > 0 else []
        return LogText("".join(kept), f"{exc}; showing the tail kept when the run ended ({local})")


def follow_log(run: Run, write: Callable[[bytes], None], sleep: Callable[[float], None] = time.sleep,
               offset: int | None = None) -> None:
    """Write the log's new bytes as they come (every second: someone reads along), until the job ended;
    from `offset` (where a tail ended), else from the log's end now."""
    job = run.refresh().job
    if job is None:
        return
    if offset is None:
        size = agent.call(run.transport, "size", path=run.paths.log)["size"]
        offset = size if isinstance(size, int) else 0
    interval = follow_log_s(run.host)
    while True:
        state = run.executor.poll(run.paths, job, offset, 4 << 20)
        write(state.data)
        offset = state.offset + len(state.data)
        if not state.alive and offset >= state.size:
            return
        sleep(interval)
