"""The plugin interface of a package that only keeps tables about runs (the `orch.run_tables` entry points,
docs/plugins.md): what it subclasses and returns. `orchestrator.playbook` offers the same names beside the
playbook interface; this module is the light one, so that `orch status ID`, which loads every such plugin,
does not bring in pydantic and the SSH stack with it."""

from __future__ import annotations

from .errors import OrchError, UsageError
from .store.record import RunRecord, Status
from .store.runtables import LineReader, RunTables, Shown

__all__ = ["LineReader", "OrchError", "Run", "RunTables", "Shown", "Status", "UsageError"]
