"""Where the inventory, the runs and the database live: the current directory or $ORCH_HOME."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

LOCAL = "local"  # the built-in host: this machine, no SSH


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
        """Local artifacts of a run: spec.json, the fetched log tail, the outputs manifest."""
        path = self.runs_dir / str(run_id)
        path.mkdir(parents=True, exist_ok=True)
        return path
