"""The plugin interface: what a playbook is, and what it is handed.

A playbook is a Spec (a Pydantic model) and a few small steps. It never sees the store or how commands
reach the host: `prepare` gets a `JobContext` and returns what it found as a `Prepared` value that
`command` then turns into the job's shell lines; `finish` returns the run's `Outputs`. The run flow
(runflow.py) calls these in order and records everything.

Plugins import this module only: it re-exports the few helpers they need.
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
from .store.record import Run, Status

S = TypeVar("S", bound=RunSpec)

# Looks up a run of this workspace by id (raises NotFound), read-only.
FindRun = Callable[[int], Run]


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
    printed and answered as an empty host would (nothing there, no output)."""

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
class JobContext(Generic[S]):
    run_id: int
    spec: S
    host: Host
    paths: RunPaths
    remote: Remote
    find_run: FindRun
    event: Callable[[str, str], None]  # (kind, message): an event on the run
    dry_run: bool = False  # commands are printed, not run: answers are empty

    @property
    def python(self) -> str:
        return self.spec.python or self.host.python


@dataclass(frozen=True)
class Prepared:
    """What `prepare` found or decided, for `command`: job environment and launch arguments."""

    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)


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

    def check_inputs(self, spec: S, host: Host, find_run: FindRun) -> None:
        """Refuse (UsageError) input that only other runs or the inventory can judge, before the run exists."""

    def preflight(self, job: JobContext[S]) -> None:
        """Look at the host, read-only, before anything there is changed (GPU cleanup, patches): refuse
        (UsageError) what the host says cannot work."""

    def prepare(self, job: JobContext[S]) -> Prepared:
        """Look at the host and upload what the job needs into its run dir."""
        return Prepared()

    def command(self, job: JobContext[S], prepared: Prepared) -> str:
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

    def finish(self, job: JobContext[S], run: Run) -> Outputs:
        """Collect outputs and metrics after the job ended (whatever the end)."""
        return Outputs()


__all__ = [
    "SERVING_PHASES", "Entry", "FindRun", "HealthCheck", "Host", "JobContext", "NotFound", "OrchError", "Outputs", "Playbook", "Prepared",
    "Remote", "Run", "RunSpec", "Status", "Usage", "UsageError", "check_regex", "http_probe", "quote",
]
