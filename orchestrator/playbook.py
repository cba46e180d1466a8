"""The plugin interface: what a playbook is, and what it is handed.

A playbook is a Spec (a Pydantic model) and a few small steps. It never sees the store or how commands
reach the host: `prepare` gets a `JobContext` and returns what it found as a `Prepared` value that
`command` then turns into the job's shell lines; `finish` returns the run's `Outputs`. The run flow
(runflow/) calls these in order and records everything.

A plugin may also keep tables about runs (RunTables, see store/runtables.py): its own migrations make them, its
line readers fill them from any run's log, and `orch status ID` shows them as a section named after it.

Plugins import this module only: it re-exports the few helpers they need. A package that only keeps tables
about runs imports the lighter `orchestrator.run_tables` instead (the same names for tables, without what
a playbook needs: pydantic, the SSH stack).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Generic, Protocol, TypeVar

from .config.hosts import Host
from .config.spec import RunSpec, check_regex
from .errors import NotFound, OrchError, UsageError
from .host.health import SERVING_PHASES, HealthCheck
from .host.health import probe as http_probe
from .host.launch import RunPaths
from .host.remote import Result, quote
from .store.record import RunRecord, Status
from .store.runtables import LineReader, RunTables, Shown

S = TypeVar("S", bound="RunSpec")

# What every node of a multi-node run finds in its job's environment, under torchrun's own names: how many
# nodes, this node's rank (the head is 0), the head's address and the rendezvous port there. A playbook's
# command refers to them ("$NODE_RANK"), so the same command serves every node, over SSH or under Slurm.
NODE_ENV = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")

# How each launcher names the rendezvous, as (flag, value) with the values NODE_ENV references: torchrun's
# static rendezvous (vLLM's multi-node "mp" backend takes the same four flags) and SGLang's server args.
RENDEZVOUS: dict[str, tuple[tuple[str, str], ...]] = {
    "torchrun": (("--nnodes", "$NNODES"), ("--node-rank", "$NODE_RANK"), ("--master-addr", "$MASTER_ADDR"),
                 ("--master-port", "$MASTER_PORT")),
    "sglang": (("--nnodes", "$NNODES"), ("--node-rank", "$NODE_RANK"),
               ("--dist-init-addr", "$MASTER_ADDR:$MASTER_PORT")),
}


def rendezvous_args(style: str) -> list[str]:
    """The launcher's rendezvous flags as argv words, the values unexpanded ("$NODE_RANK"): what a patch
    set's flag check sees."""
    return [word for pair in RENDEZVOUS[style] for word in pair]


def rendezvous(style: str) -> str:
    """The launcher's rendezvous flags for a bash command line: each value in double quotes, so that every
    node's job expands its own NODE_ENV (one command line serves every node)."""
    return " ".join(f'{flag} "{value}"' for flag, value in RENDEZVOUS[style])

def other_nodes_only(command: str) -> str:
    """A shell line that, on every node but the head, runs `command` in the foreground and ends the job with
    its exit code; the head goes on to the lines after it (a server's other nodes: their share only)."""
    return f'if [ "$NODE_RANK" != 0 ]; then {command}; exit $?; fi'


# Looks up a run of this workspace by id (raises NotFound), read-only.
FindRun = Callable[[int], RunRecord]


@dataclass(frozen=True)
class Entry:
    """One entry of a host's directory, as it is (a symlink is a "link", never followed)."""

    name: str
    kind: str  # file | dir | link | other
    size: int


@dataclass(frozen=True)
class Usage:
    """What a host's directory holds at any depth, as `find DIR -mindepth 1`, `du -sb` and `du -sk` count it."""

    entries: int
    bytes: int
    kib: int


class Remote(Protocol):
    """The host a job runs on, as a playbook may use it: run a command, upload a file, and look at files
    and ask a program without a shell. The looks are read-only, answered by the host's agent; a relative
    path is taken from the run dir, as the job sees it. In a dry run nothing is asked: each look is
    recorded and answered as an empty host would (nothing there, no output)."""

    def run(self, command: str, *, check: bool = True, timeout: float | None = None) -> Result: ...

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None: ...

    def exists(self, path: str) -> bool:
        """As `test -e`: a symlink counts as what it points to."""
        ...

    def is_file(self, path: str) -> bool:
        """As `test -f`."""
        ...

    def is_dir(self, path: str) -> bool:
        """As `test -d`."""
        ...

    def list_dir(self, path: str) -> list[Entry] | None:
        """The directory's entries by name; None when there is no directory."""
        ...

    def usage(self, path: str) -> Usage | None:
        """What the directory holds at any depth; None when there is no directory."""
        ...

    def read_text(self, path: str, limit: int = 1 << 20) -> str | None:
        """The first `limit` bytes of a plain file (never read through a symlink); None when there is none."""
        ...

    def run_argv(self, argv: list[str], *, check: bool = True, timeout: float | None = None) -> Result:
        """Run a program from its argv list, no shell in between (stdin empty; stdout and stderr apart)."""
        ...


@dataclass(frozen=True)
class RunContext(Generic[S]):
    run_id: int
    spec: S
    host: Host
    paths: RunPaths
    remote: Remote
    find_run: FindRun
    event: Callable[[str, str], None]  # (kind, message): an event on the run
    dry_run: bool = False  # nothing reaches the host: requests are recorded, answers are an empty host's

    @property
    def python(self) -> str:
        return self.spec.python or self.host.python


@dataclass(frozen=True)
class Prepared:
    """What `prepare` found or decided, for `command`: job environment and launch arguments."""

    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    engine_version: str | None = None  # the installed engine's, when prepare looked: the log is read for it


@dataclass(frozen=True)
class Outputs:
    """What `finish` collected: a manifest (saved as runs/<id>/outputs.json) and metric samples."""

    manifest: object | None = None
    metrics: list[tuple[str, float]] = field(default_factory=list)


class Playbook(Generic[S]):
    name: ClassVar[str]
    Spec: type[S]
    engine: ClassVar[str | None] = None  # log format hint for the watcher
    # Holds its host (or GPU set) while it runs; a client of a server on that host (a benchmark) does not.
    exclusive: ClassVar[bool] = True
    # Spans several hosts when `spec.nodes` > 1: its command then reads the rendezvous from NODE_ENV, which
    # every node's job has in its environment (see `rendezvous`). The run's health, url and ready line are the
    # head's (rank 0): only the head is probed.
    multi_node: ClassVar[bool] = False
    # The metrics its runs lead with, in the order a person reads them (a plugin's; the built-ins' are in
    # config/metricinfo.py, read without loading any playbook).
    headlines: ClassVar[tuple[str, ...]] = ()

    def check_inputs(self, spec: S, host: Host, find_run: FindRun) -> None:
        """Refuse (UsageError) input that only other runs or the inventory can judge, before the run exists."""

    def preflight(self, run: RunContext[S]) -> None:
        """Look at the host, read-only, before anything there is changed (GPU cleanup, patches): refuse
        (UsageError) what the host says cannot work."""

    def prepare(self, run: RunContext[S]) -> Prepared:
        """Look at the host and upload what the job needs into its run dir."""
        return Prepared()

    def command(self, run: RunContext[S], prepared: Prepared) -> str:
        """The job's shell command lines (values quoted)."""
        raise NotImplementedError

    def cwd(self, spec: S) -> str | None:
        return None

    def engine_argv(self, spec: S) -> list[str] | None:
        """The engine's command line, to check the flags a patch set requires; None: not an engine launch."""
        return None

    def ready_pattern(self, spec: S) -> str | None:
        return None

    def log_engine(self, spec: S) -> str | None:
        """Log format hint for this spec (a playbook with several backends prints several formats)."""
        return self.engine

    def health(self, spec: S, host: Host) -> HealthCheck | None:
        """A server's health probe, asked on each poll while it is ready; None: no endpoint."""
        return None

    def url(self, spec: S, host: Host) -> str | None:
        """Where a ready server answers (as the host sees it); None: not a server."""
        return None

    def finish(self, run: RunContext[S], record: RunRecord) -> Outputs:
        """Collect outputs and metrics after the job ended (whatever the end)."""
        return Outputs()


__all__ = [
    "NODE_ENV", "RENDEZVOUS", "SERVING_PHASES", "Entry", "FindRun", "HealthCheck", "Host", "JobContext", "LineReader", "NotFound", "OrchError", "Outputs",
    "Playbook", "Prepared", "Remote", "Run", "RunSpec", "RunTables", "Shown", "Status", "Usage", "UsageError", "check_regex",
    "http_probe", "other_nodes_only", "quote", "rendezvous", "rendezvous_args",
]
