"""Where the inventory, the runs and the database live: the current directory or $ORCH_HOME."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

LOCAL = "local"  # the built-in host: this machine, no SSH
# What orch writes in the workspace (the database, logs, spec files, runs/<id>/) holds specs, log lines and
# hosts' names: its owner's alone, whatever the umask. The user's own umask is kept for the jobs orch starts
# on this machine, handed down to orch's own background programs (host watchers, sweeps) in this variable.
USER_UMASK_VAR = "ORCH_USER_UMASK"


@contextmanager
def owner_only() -> Iterator[None]:
    """What this process creates meanwhile is its owner's alone (umask 077); the umask as it was after."""
    before = os.umask(0o077)
    handed_down = USER_UMASK_VAR in os.environ
    os.environ.setdefault(USER_UMASK_VAR, f"{before:03o}")
    try:
        yield
    finally:
        os.umask(before)
        if not handed_down:
            os.environ.pop(USER_UMASK_VAR, None)


def user_umask() -> int | None:
    """The umask the user started orch with, for a job started on this machine; None: orch's is the user's."""
    text = os.environ.get(USER_UMASK_VAR, "")
    try:
        return int(text, 8) & 0o777 if text else None
    except ValueError:
        return None


@dataclass(frozen=True)
class Workspace:
    root: Path
    hosts_file: Path

    @classmethod
    def find(cls, hosts_file: str | os.PathLike | None = None) -> Workspace:
        root = Path(os.environ.get("ORCH_HOME") or os.getcwd()).resolve()
        hosts = Path(hosts_file).resolve() if hosts_file else root / "hosts.toml"
        return cls(root=root, hosts_file=hosts)

    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def db_path(self) -> Path:
        return self.runs_dir / "orch.db"

    def run_dir(self, run_id: int) -> Path:
        """Local artifacts of a run: spec.json, the fetched log tail, the outputs manifest (owner-only)."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.runs_dir.mkdir(mode=0o700, exist_ok=True)
        path = self.runs_dir / str(run_id)
        path.mkdir(mode=0o700, exist_ok=True)
        return path
