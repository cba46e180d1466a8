"""The inventory: hosts (list, --check) and gpus (what each GPU holds)."""

from __future__ import annotations

from typing import Any

import typer

from ..config.workspace import LOCAL
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
        from ..host import fleet

        found = fleet.check(list(inv.hosts.values()), timeout, scheduler=_ping_scheduler)
        for row in rows:
            row.update(found[row["name"]])
    if as_json:
        emit_json(rows)
    else:
        cols = ["name", "address", "gpus", "tags"] + (["ok", "uname", "scheduler", "error"] if check else [])
        table(cols, [[r.get(c) for c in cols] for r in rows])
    if check and not all(r["ok"] for r in rows):
        raise typer.Exit(1)


def _ping_scheduler(host: Any, timeout: float) -> str:
    from ..host.remote import connect
    from ..host.slurm import ping

    return ping(connect(host), timeout)


def _cluster_gpus(host: Any) -> list[dict[str, Any]]:
    from ..host.remote import connect
    from ..host.slurm import gpus_by_node

    return gpus_by_node(connect(host))


@app.command()
def gpus(
    host: list[str] = typer.Option([], "--host", "-H", help="hosts to ask (default: local)"),
    all_hosts: bool = typer.Option(False, "--all", help="every host of the inventory"),
    as_json: bool = typer.Option(False, "--json"),
    timeout: float = typer.Option(30.0, help="seconds per host"),
) -> None:
    """GPU memory, utilisation and processes per host, with the orch run holding each."""
    from ..host import gpu
    from ..host.executor import executor_class

    ws = workspace()
    inv = inventory(ws)
    targets = inv.select(None) if all_hosts else [inv.get(h) for h in (host or [LOCAL])]
    scheduled = {h.name for h in targets if executor_class(h).schedules_gpus}
    clusters = {h.name: _cluster_gpus(h) for h in targets if h.name in scheduled}  # the scheduler's view, by node
    found = gpu.snapshots([h for h in targets if h.name not in scheduled], read_store(ws), timeout=timeout)
    if as_json:
        emit_json({**{name: gpu.host_document(name, s) for name, s in found.items()},
                   **{name: {"host": name, "nodes": nodes} for name, nodes in clusters.items()}})
    else:
        if found:
            table(gpu.TABLE_HEADERS, gpu.table_rows(found))
        for name, nodes in clusters.items():
            table([f"{name} node", "gpus", "in use", "state", "partitions"],
                  [[n["node"], n["gpus"], n["used"], n["state"], ", ".join(n["partitions"] or [])] for n in nodes])
    if any(isinstance(s, Exception) for s in found.values()):
        raise typer.Exit(1)


