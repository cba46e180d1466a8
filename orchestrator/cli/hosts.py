"""The inventory: hosts (list, --check) and gpus (what each GPU holds)."""

from __future__ import annotations

from typing import Any

import typer

from ..workspace import LOCAL
from .app import app, inventory, read_store, workspace
from .render import emit_json, table


@app.command()
def hosts(
    check: bool = typer.Option(False, "--check", help="connect to every host (in parallel)"),
    as_json: bool = typer.Option(False, "--json"),
    timeout: float = typer.Option(15.0, help="seconds per host for --check"),
) -> None:
    """List the inventory; --check connects to each host."""
    ws = workspace()
    inv = inventory(ws)
    rows: list[dict[str, Any]] = [
        {"name": h.name, "address": h.address or h.name, "user": h.user, "port": h.port, "gpus": h.gpus,
         "tags": h.tags, "workdir": h.workdir} for h in inv.hosts.values()]
    if check:
        from .. import fleet

        found = fleet.check(list(inv.hosts.values()), timeout)
        for row in rows:
            row.update(found[row["name"]])
    if as_json:
        emit_json(rows)
    else:
        cols = ["name", "address", "gpus", "tags"] + (["ok", "uname", "error"] if check else [])
        table(cols, [[r.get(c) for c in cols] for r in rows])
    if check and not all(r["ok"] for r in rows):
        raise typer.Exit(1)


@app.command()
def gpus(
    host: list[str] = typer.Option([], "--host", "-H", help="hosts to ask (default: local)"),
    all_hosts: bool = typer.Option(False, "--all", help="every host of the inventory"),
    as_json: bool = typer.Option(False, "--json"),
    timeout: float = typer.Option(30.0, help="seconds per host"),
) -> None:
    """GPU memory, utilisation and processes per host, with the orch run holding each."""
    from .. import gpu

    ws = workspace()
    inv = inventory(ws)
    targets = inv.select(None) if all_hosts else [inv.get(h) for h in (host or [LOCAL])]
    found = gpu.snapshots(targets, read_store(ws), timeout=timeout)
    if as_json:
        emit_json({name: gpu.host_document(name, s) for name, s in found.items()})
    else:
        table(gpu.TABLE_HEADERS, gpu.table_rows(found))
    if any(isinstance(s, Exception) for s in found.values()):
        raise typer.Exit(1)


