"""What one orch process holds while it runs, in one object: the plugins it found installed and loaded
(playbooks, patch sets, tables about runs), the headline metrics they declared, the notifications still
being sent, and its host session (host/session.py: the options that concern every host, its connections,
agent links and queue readers). `current()` is it; a test gets a `fresh()` one, as a new process would have.

Nothing of orch is imported here (a leaf): each module that keeps something here knows its type.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class State:
    # config/metricinfo.declare: a plugin playbook's headline metrics, by its name
    headlines: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # runflow/registry: each playbook's `module:Class` by name (None: not looked up yet), each playbook
    # loaded, by name, and the folder holding each installed patch set, by its name
    playbook_targets: dict[str, str] | None = None
    playbooks: dict[str, Any] = field(default_factory=dict)
    patch_set_dirs: dict[str, Path] | None = None
    # store/runtables: each plugin's `module:Class` by name, then those loaded and the errors of the others
    run_table_targets: dict[str, str] | None = None
    run_tables: tuple[tuple[Any, ...], tuple[str, ...]] | None = None
    # runflow/notify: the sends still in flight, which a command waits for before it exits
    notify_sends: list[Any] = field(default_factory=list)
    # host/session: made on first use (a command that reaches no host never imports it)
    host_session: Any = None


_current = State()


def current() -> State:
    return _current


@contextmanager
def fresh() -> Iterator[State]:
    """A new state for what runs inside; the one before is put back after."""
    global _current
    before, _current = _current, State()
    try:
        yield _current
    finally:
        _current = before
