"""Tables a plugin keeps about runs: made by migrations of its own, filled from a run's log by its line
readers, shown by `orch status ID` (and its JSON) as a section named after it.

A plugin subclasses RunTables; `installed()` finds them (orch's own by module path, a package's through the
`orch.run_tables` entry points, `name = "module:Class"`; a built-in name cannot be taken over). That is
done here rather than in the registry (runflow/registry.py) so that `orch status ID`, which shows every
plugin's section, stays clear of what playbooks and patch sets need (pydantic, the SSH stack). Its
migrations are a sqlite-utils migration set of its own (`plugin:<name>`), never part of orch's schema: they are applied when orch first uses the plugin with a
database (before storing its first rows, or reading its section), and from then on whenever one is new.
Every registered plugin's readers see every run's log: a line is its by its marker, whoever printed it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from sqlite_utils import Database

from .. import state
from ..errors import UsageError

NAME_PATTERN = r"^[a-z][a-z0-9_]*$"  # a section's JSON key, a migration set's and a table's name alike
BUILTIN = {
    "eagle3_debug": "playbooks.eagle3_debug:Eagle3Debug",  # the sglang-eagle3-hidden-debug patch set's lines
}
ENTRY_POINTS = "orch.run_tables"
# The fields of a run's document (shapes.run_document) and of the dashboard's run page: no section takes one.
TAKEN = frozenset((
    "id", "name", "tags", "note", "playbook", "host", "status", "phase", "shown_status", "shown_phase", "stalled",
    "progress", "error", "reason", "metrics", "metric_summaries", "exit_code", "pid", "job_id", "node",
    "queue_reason", "remote_dir", "sweep_id", "created_at", "created_at_iso", "started_at", "started_at_iso",
    "ended_at", "ended_at_iso", "predicted_ready_at", "predicted_ready_at_iso", "unreachable_since",
    "unreachable_since_iso", "duration_s", "spec", "end_steps", "events", "url",
    "point", "last_line", "heartbeat", "progress_at", "watcher", "timeline", "spec_keys", "patches", "outputs",
    "reproduce", "parent_id", "node_rank", "hosts", "nodes", "headlines", "receipt", "invalid",
))

Migration = Callable[["Database"], None]


@dataclass(frozen=True)
class LineReader:
    """How a plugin reads its lines: each line of a run's log (cleaned: prefixes and colour codes as the log
    parser leaves them) that holds `marker` is handed to `read`; a row it returns (column: value) goes into
    `table`, with the run's id, when it was read (`ts`) and the line's number (`line`). A line it cannot read
    is None, never an exception: `read` runs inside every watcher."""

    table: str
    marker: str
    read: Callable[[str], dict[str, Any] | None]


@dataclass(frozen=True)
class Shown:
    """A section as `orch status ID` prints it: a title line, then a table."""

    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)


class RunTables:
    """A plugin's tables about runs. A table its readers fill has the columns `run_id`, `ts` and `line` besides
    those of the rows they return."""

    name: ClassVar[str]  # its section in `orch status ID --json`; its migration set is `plugin:<name>`
    # (name, function of a sqlite_utils.Database), in order; as orch's own, one that has shipped is never edited
    migrations: ClassVar[Sequence[tuple[str, Migration]]] = ()
    readers: ClassVar[Sequence[LineReader]] = ()

    @property
    def migration_set(self) -> str:
        return f"plugin:{self.name}"

    def section(self, db: Database, run_id: int) -> Any:
        """The run's section of `orch status ID --json` (JSON values), read from the plugin's own tables and
        views; None: the run has none."""
        return None

    def show(self, section: Any) -> Shown | None:
        """How `orch status ID` prints the section; None: not at all."""
        return None


def problems(tables: RunTables) -> list[str]:
    """What makes a plugin's declaration unusable: names the database and the JSON cannot take."""
    found = []
    name = getattr(tables, "name", None)
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        found.append(f"its name {name!r} does not match {NAME_PATTERN}")
    elif name in TAKEN:
        found.append(f"{name!r} is a field of `orch status ID --json` already")
    for reader in tables.readers:
        if not isinstance(reader, LineReader):
            found.append(f"{reader!r} is not a LineReader")
        elif not re.fullmatch(NAME_PATTERN, reader.table) or not reader.marker:
            found.append(f"reader of {reader.table!r}: a table name matching {NAME_PATTERN} and a marker are needed")
    if tables.readers and not tables.migrations:
        found.append("it reads rows but has no migration to make their tables")
    return found


def _targets() -> dict[str, str]:
    held = state.current()
    if held.run_table_targets is None:
        from importlib import metadata  # scans the installed packages: only where plugins are wanted

        held.run_table_targets = {**{ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINTS)},
                                  **BUILTIN}
    return held.run_table_targets


def _load(name: str, target: str) -> RunTables:
    module, _, attr = target.partition(":")
    if name in BUILTIN:  # orch's own: one that fails to load is a bug, with its traceback
        found = getattr(importlib.import_module(module), attr)()
    else:
        # a package may be broken or half-installed: said in one line, orch goes on
        try:
            found = getattr(importlib.import_module(module), attr)()
        except Exception as exc:  # noqa: BLE001 - whatever its import or constructor raises
            what = " ".join(str(exc).split())[:300]
            raise UsageError(f"run tables {name!r} ({target}) cannot be loaded: {type(exc).__name__}"
                             + (f": {what}" if what else "")) from None
    if not isinstance(found, RunTables) or getattr(found, "name", None) != name:
        raise UsageError(f"run tables {name!r} ({target}) is not a RunTables named {name!r}")
    wrong = problems(found)
    if wrong:
        raise UsageError(f"run tables {name!r} ({target}): {'; '.join(wrong)}")
    return found


def _installed() -> tuple[tuple[RunTables, ...], tuple[str, ...]]:
    """Every plugin loaded once a process: those that load, and the errors of those that do not."""
    held = state.current()
    if held.run_tables is None:
        found, broken = [], []
        for name, target in sorted(_targets().items()):
            try:
                found.append(_load(name, target))
            except UsageError as exc:
                broken.append(str(exc))
        held.run_tables = tuple(found), tuple(broken)
    return held.run_tables


def installed(on_broken: Callable[[str], None] | None = None) -> list[RunTables]:
    """Every plugin's tables about runs; one that cannot be loaded is left out, and its error told to
    on_broken when given."""
    found, broken = _installed()
    if on_broken is not None:
        for line in broken:
            on_broken(line)
    return list(found)
