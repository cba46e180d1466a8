"""The Typer app, its global options, and what every command needs: the workspace, its store, its hosts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from ..errors import UsageError
from ..store import Store
from ..workspace import Workspace

if TYPE_CHECKING:
    from ..hosts import Inventory

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Run and watch large-model experiments.")


class State:
    hosts_file: Path | None = None


@app.callback()
def _global(hosts: Path | None = typer.Option(None, "--hosts", help="inventory file (default hosts.toml)")) -> None:
    State.hosts_file = hosts


def workspace() -> Workspace:
    return Workspace.find(State.hosts_file)


def open_store(ws: Workspace) -> Store:
    return Store(ws.db_path)


def inventory(ws: Workspace) -> Inventory:
    from ..hosts import Inventory  # pydantic: only for the commands that need hosts

    return Inventory.load(ws.hosts_file, ws.root)


def parse_run_id(text: str) -> int:
    if not text.isdigit():
        raise UsageError(f"not a run id: {text!r}")
    return int(text)
