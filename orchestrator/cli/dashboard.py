"""`orch ui`: the web dashboard of this workspace."""

from __future__ import annotations

import typer

from .app import app, workspace
from .render import err


@app.command()
def ui(port: int = typer.Option(8765, "--port"),
       bind: str = typer.Option("127.0.0.1", "--bind", help="loopback unless a --token guards it"),
       allow_actions: bool = typer.Option(False, "--allow-actions", help="cancel and stop from the pages"),
       token: str | None = typer.Option(None, "--token", envvar="ORCH_UI_TOKEN",
                                        help="what a browser must show (default: a new one each start)")) -> None:
    """A web dashboard of this workspace: runs, sweeps, hosts, live; read-only unless --allow-actions."""
    from .. import ui as dashboard

    dashboard.serve(workspace(), port=port, bind=bind, allow_actions=allow_actions, token=token, echo=err.print)
