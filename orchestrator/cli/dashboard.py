"""`orch ui`: the web dashboard of this workspace."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import UsageError
from .app import app, workspace
from .render import err


@app.command()
def ui(port: int = typer.Option(8765, "--port"),
       bind: str = typer.Option("127.0.0.1", "--bind", help="loopback unless a token guards it"),
       allow_actions: bool = typer.Option(False, "--allow-actions", help="cancel and stop from the pages"),
       token_file: Path | None = typer.Option(None, "--token-file", metavar="FILE",
                                              help="the token a browser must show, from FILE (yours alone: 0600); "
                                                   "or ORCH_UI_TOKEN; default: a new one each start"),
       token: str | None = typer.Option(None, "--token", hidden=True)) -> None:
    """A web dashboard of this workspace: runs, sweeps, hosts, live; read-only unless --allow-actions."""
    from .. import ui as dashboard
    from ..ui.guard import given_token

    if token is not None:  # refused, not taken: a command line is in every local user's `ps`
        raise UsageError("--token would show the token to every user of this machine (ps): set ORCH_UI_TOKEN "
                         "or give --token-file FILE (yours alone, chmod 600)")
    dashboard.serve(workspace(), port=port, bind=bind, allow_actions=allow_actions, token=given_token(token_file),
                    echo=err.print)
