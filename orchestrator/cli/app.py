"""The Typer app, its global options, and what every command needs: the workspace, its store, its hosts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from typer.core import TyperArgument, TyperOption

from ..errors import UsageError
from ..store import Store
from ..workspace import Workspace
from .render import err

if TYPE_CHECKING:
    from ..hosts import Inventory

app = typer.Typer(no_args_is_help=True, help="Run and watch large-model experiments.")

# Help shows Python type names (`<bool>` after a flag, `<list[str]>`); a person reads TEXT, NUMBER, or nothing.
_TYPE_WORDS = {"str": "TEXT", "int": "INTEGER", "float": "NUMBER", "path": "PATH"}
_option_type = TyperOption.display_type_rich


def _option_metavar(self: TyperOption, ctx: typer.Context) -> str | None:
    if self.is_flag:
        return None
    shown = _option_type(self, ctx)
    if self.metavar is not None or shown is None:
        return shown
    bare = shown.strip("<>.").removeprefix("list[").removesuffix("]")
    return _TYPE_WORDS.get(bare, bare) + ("..." if shown.endswith("...") else "")


TyperOption.display_type_rich = _option_metavar  # type: ignore[method-assign,assignment]
TyperArgument.display_type_rich = lambda self, ctx: None  # type: ignore[method-assign]  # its name says it


class State:
    hosts_file: Path | None = None
    quiet_retries = False  # --json: stderr carries no retry lines (stdout is the document)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"orch {version('orch')}")
        raise typer.Exit()


@app.callback()
def _global(hosts: Path | None = typer.Option(None, "--hosts", help="inventory file (default hosts.toml)"),
            _: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                   help="print orch's version and exit")) -> None:
    State.hosts_file = hosts


def workspace() -> Workspace:
    return Workspace.find(State.hosts_file)


def open_store(ws: Workspace) -> Store:
    return Store(ws.db_path)


def read_store(ws: Workspace) -> Store:
    """For commands that only read: a missing database is not created; an empty one in memory stands in."""
    return Store(ws.db_path) if ws.db_path.exists() else Store(":memory:")


def no_runs_note(ws: Workspace) -> None:
    """Say where orch looked when there is no database there (a folder that is no workspace, or a new one)."""
    if not ws.db_path.exists():
        import os

        where = "$ORCH_HOME" if os.environ.get("ORCH_HOME") else "the current directory"
        err.print(f"orch: no runs here: {ws.db_path} does not exist (the workspace is {where}: {ws.root})")


def inventory(ws: Workspace) -> Inventory:
    from .. import ssh
    from ..hosts import Inventory  # pydantic: only for the commands that need hosts

    if not State.quiet_retries:  # every command that reaches a host comes through here
        ssh.retry_notice = lambda line: err.print(f"orch: {line}")
    return Inventory.load(ws.hosts_file, ws.root)


def parse_run_id(text: str) -> int:
    # ASCII digits only (isdigit() takes '²' and Arabic-Indic digits), and within SQLite's integers
    if not re.fullmatch(r"[0-9]{1,18}", text):
        raise UsageError(f"not a run id: {text[:40]!a}")
    return int(text)


def age_seconds(text: str) -> float:
    """An age such as 30d, 12h, 90m or 45s, in seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    number, unit = text[:-1], text[-1:]
    if unit not in units or not number.replace(".", "", 1).isdigit():
        raise UsageError(f"not an age: {text!r} (e.g. 30d, 12h, 90m, 45s)")
    return float(number) * units[unit]
