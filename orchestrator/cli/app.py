"""The Typer app, its global options, and what every command needs: the workspace, its store, its hosts."""

from __future__ import annotations

import re
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from typer import _click as click  # Typer's own copy of click: its Command and Context
from typer.core import TyperGroup

from ..config.workspace import Workspace
from ..errors import UsageError
from ..host import session
from ..store import Store
from .render import err

if TYPE_CHECKING:
    from ..config.hosts import Inventory

# Every command and the module of this package that declares it, in the order `orch --help` lists them.
COMMAND_MODULES = {
    "playbooks": "catalog", "ui": "dashboard", "hosts": "hosts", "gpus": "hosts", "inspect-log": "inspect",
    "compare": "inspect", "logs": "logs", "pull": "logs", "ssh": "logs", "run": "runs", "rerun": "runs",
    "watch": "runs", "watch-host": "runs", "note": "runs", "tag": "runs", "cancel": "runs", "stop": "runs",
    "rm": "runs", "gc": "runs", "status": "status", "patch": "patches", "sweep": "sweeps", "cron": "sweeps",
    "export": "export",
}


class LazyGroup(TyperGroup):
    """`orch` itself, through click's two hooks for a group's commands (`list_commands`, `get_command`): a
    command's module is imported, and its Typer function made a click command, when the command is first
    looked up. Running a command builds that one alone; help and completion, which list them all, build
    them all."""

    def list_commands(self, ctx: typer.Context) -> list[str]:  # type: ignore[override]
        return list({**dict.fromkeys(COMMAND_MODULES), **self.commands})

    def get_command(self, ctx: typer.Context, name: str) -> click.Command | None:  # type: ignore[override]
        if name not in self.commands and name in COMMAND_MODULES:
            import_module(f"{__package__}.{COMMAND_MODULES[name]}")
            # Typer builds every command its app declares so far (of the modules imported): the new ones are kept.
            built = typer.main.get_command(app)
            assert isinstance(built, TyperGroup)
            for known, command in built.commands.items():
                self.commands.setdefault(known, command)
        return self.commands.get(name)

    def resolve_command(self, ctx: typer.Context, args: list[str]) -> Any:  # type: ignore[override]
        if args and self.get_command(ctx, args[0]) is None:
            for name in self.list_commands(ctx):  # a name orch lacks: the suggestion may be any command
                self.get_command(ctx, name)
        return super().resolve_command(ctx, args)


# Typer as pyproject.toml pins it (0.26): values are parsed by click's own types, and help names them as
# click does (TEXT, INTEGER, FLOAT, PATH; nothing after a flag). Typer 0.27 shows Python's names instead
# (`<str>`), and 0.29 parses every value, even one not given, with pydantic, whose import alone costs
# `orch status` as much as Typer and Rich together (bench/status_startup.py).
app = typer.Typer(cls=LazyGroup, no_args_is_help=True, help="Run and watch large-model experiments.")

def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"orch {version('orch')}")
        raise typer.Exit()


@app.callback()
def _global(hosts: Path | None = typer.Option(None, "--hosts", help="inventory file (default hosts.toml)"),
            _: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                   help="print orch's version and exit")) -> None:
    session.current().hosts_file = hosts


def workspace() -> Workspace:
    return Workspace.find(session.current().hosts_file)


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
    from ..config.hosts import Inventory

    held = session.current()
    if not held.quiet_retries:  # every command that reaches a host comes through here
        held.retry_notice = lambda line: err.print(f"orch: {line}")
        if err.is_terminal:  # a person watching: transfers show a bar (a pipe or a log file gets none)
            from .render import transfer_bar

            held.transfer_meter = transfer_bar
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
