"""Commands on a run's log and run dir: logs, pull, ssh."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import typer

from ..errors import OrchError, UsageError
from .app import app, inventory, parse_run_id, read_store, workspace
from .render import emit_json, err, out


@app.command(epilog="Examples:\n\n  orch logs 7 -n 200\n\n  orch logs 7 -f\n\n  orch logs 7 --all > run7.log"
                     "\n\n  orch logs 7 --node 1")
def logs(
    run_id: str = typer.Argument(..., metavar="ID"),
    lines: int = typer.Option(40, "-n", "--lines", metavar="N"),
    whole: bool = typer.Option(False, "--all", help="the whole log from the host, streamed"),
    follow: bool = typer.Option(False, "-f", "--follow", help="print new lines as they come, until the job ends"),
    node: int | None = typer.Option(None, "--node", metavar="RANK", help="a multi-node run: this node's log only"),
    as_json: bool = typer.Option(False, "--json", help="{run_id, source, note, lines} (a multi-node run: nodes too)"),
) -> None:
    """Print the last lines of a run's log: from its host, or the tail kept locally when the host is down.
    A multi-node run's: every node's, each line headed `[RANK HOST] `, or one node's with --node."""
    from .. import runflow

    ws = workspace()
    store = read_store(ws)
    rid = parse_run_id(run_id)
    nodes = store.nodes_of(rid)
    if node is not None:
        rid = _node_id(rid, nodes, node)
    elif nodes and nodes[0].id == rid:  # the run (its head): every node's; a node's own id shows that node's
        _node_logs(ws, store, rid, nodes, lines, whole, follow, as_json)
        return
    if whole:
        _whole_log(runflow.open_run(ws, store, rid, inventory(ws), any_spec=True))
        return
    found = runflow.read_log(ws, store, rid, lines, inventory(ws))
    if found.fallback:
        err.print(f"orch: {found.fallback}")
    if as_json:
        emit_json({"run_id": rid, "source": "local" if found.fallback else "host", "note": found.fallback,
                   "lines": found.text.splitlines()})
        return
    tty = sys.stdout.isatty()  # a terminal acts on escape sequences in the log; a file or pipe gets it as is
    sys.stdout.write(Screen().feed(found.text.encode(), final=True) if tty else found.text)
    sys.stdout.flush()
    if follow and not found.fallback:
        _stream(lambda write: runflow.follow_log(runflow.open_run(ws, store, rid, inventory(ws)), write,
                                                 offset=found.end))


def _node_id(run_id: int, nodes: list[Any], rank: int) -> int:
    """The record of node `rank` of the run (asked by any of its nodes' ids)."""
    if not nodes:
        raise UsageError(f"run {run_id} runs on one host: it has no --node")
    for n in nodes:
        if (n.node_rank or 0) == rank:
            return int(n.id)
    ranks = ", ".join(str(n.node_rank or 0) for n in nodes)
    raise UsageError(f"run {nodes[0].id} has no node {rank} (its ranks: {ranks})")


def node_prefix(node: Any) -> bytes:
    return f"[{node.node_rank or 0} {node.host}] ".encode()


class Prefixed:
    """A node's log bytes as whole lines, each headed by the node's prefix: nodes that write at once
    interleave line by line, never inside a line. A line not yet ended waits for its end (or `flush`)."""

    def __init__(self, prefix: bytes, write: Any):
        self.prefix, self.write, self.held = prefix, write, b""

    def feed(self, data: bytes) -> None:
        data = self.held + data
        cut = data.rfind(b"\n") + 1
        self.held = data[cut:]
        if cut:
            self.write(b"".join(self.prefix + line for line in data[:cut].splitlines(keepends=True)))

    def flush(self) -> None:
        if self.held:
            self.write(self.prefix + self.held + b"\n")
            self.held = b""


def _node_logs(ws: Any, store: Any, run_id: int, nodes: list[Any], lines: int, whole: bool, follow: bool,
               as_json: bool) -> None:
    """Every node's log of a multi-node run, in rank order, each line headed by its node's rank and host;
    followed, the nodes' new lines interleaved as they come until every node's job ended. A node whose log
    cannot be read is said on stderr; the others are shown all the same."""
    import threading

    from .. import runflow

    hosts = inventory(ws)
    if whole:
        from ..runflow import fetching

        def each_whole(write: Any) -> None:
            for n in nodes:
                try:
                    run = runflow.open_run(ws, store, n, hosts, any_spec=True)
                except OrchError as exc:
                    err.print(f"orch: node {n.node_rank or 0} (run {n.id}): {exc}", markup=False)
                    continue
                lined = Prefixed(node_prefix(n), write)
                fetching.stream_log(run, lined.feed)
                lined.flush()

        _stream(each_whole)
        return
    found: dict[int, Any] = {}
    for n in nodes:
        try:
            found[n.id] = runflow.read_log(ws, store, n.id, lines, hosts)
        except OrchError as exc:
            err.print(f"orch: node {n.node_rank or 0} (run {n.id}): {exc}", markup=False)
            continue
        if found[n.id].fallback:
            err.print(f"orch: node {n.node_rank or 0}: {found[n.id].fallback}", markup=False)
    if as_json:
        docs = [{"rank": n.node_rank or 0, "id": n.id, "host": n.host,
                 "source": "local" if found[n.id].fallback else "host", "note": found[n.id].fallback,
                 "lines": found[n.id].text.splitlines()} for n in nodes if n.id in found]
        emit_json({"run_id": run_id, "lines": [node_prefix(n).decode() + line for n in nodes if n.id in found
                                               for line in found[n.id].text.splitlines()], "nodes": docs})
        return
    lock = threading.Lock()

    def each(write: Any) -> None:
        def locked(data: bytes) -> None:
            with lock:  # whole lines from one node at a time
                write(data)

        for n in nodes:
            if n.id in found:
                lined = Prefixed(node_prefix(n), locked)
                lined.feed(found[n.id].text.encode())
                lined.flush()
        if not follow:
            return
        followed = [n for n in nodes if n.id in found and not found[n.id].fallback]

        def follow_one(n: Any) -> None:
            lined = Prefixed(node_prefix(n), locked)
            try:
                runflow.follow_log(runflow.open_run(ws, store, n, hosts, any_spec=True), lined.feed,
                                   offset=found[n.id].end)
            except OrchError as exc:
                with lock:
                    err.print(f"orch: node {n.node_rank or 0} (run {n.id}): {exc}", markup=False)
            finally:
                lined.flush()

        threads = [threading.Thread(target=follow_one, args=(n,), daemon=True) for n in followed]
        for t in threads:
            t.start()
        for t in threads:  # until every node's job ended
            t.join()

    _stream(each)


class Screen:
    """Log bytes as a terminal may show them: no escape sequence it would act on (`terminal_safe`), and a
    bare '\r' as a line break: it would move the cursor back and let the next text overwrite the line
    (a progress bar's redraws become lines, as the dashboard shows them)."""

    def __init__(self) -> None:
        from ..logparse.text import TerminalText

        self.text = TerminalText()
        self.held_cr = False  # a chunk ended on '\r': whether a '\n' follows is in the next one

    def feed(self, data: bytes, final: bool = False) -> str:
        text = ("\r" if self.held_cr else "") + self.text.feed(data, final)
        self.held_cr = not final and text.endswith("\r")
        if self.held_cr:
            text = text[:-1]
        return text.replace("\r\n", "\n").replace("\r", "\n")


def _stream(source: Any) -> None:
    """Run `source(write)`, which hands over the log's bytes as they come: made safe on a terminal."""
    screen = Screen() if sys.stdout.isatty() else None

    def write(data: bytes) -> None:
        if screen is not None:
            sys.stdout.write(screen.feed(data))
        else:
            sys.stdout.buffer.write(data)
        sys.stdout.flush()

    source(write)
    if screen is not None:
        sys.stdout.write(screen.feed(b"", final=True))
        sys.stdout.flush()


def _whole_log(run: Any) -> None:
    from ..runflow import fetching

    _stream(lambda write: fetching.stream_log(run, write))


@app.command(epilog="Examples:\n\n  orch pull 7\n\n  orch pull 7 --to results/run7 --max-size 4G")
def pull(run_id: str = typer.Argument(..., metavar="ID"),
         to: Path | None = typer.Option(None, "--to", metavar="DIR", help="default: runs/<id>/pulled"),
         max_size: str = typer.Option("1G", "--max-size", metavar="SIZE", help="copy nothing above this (512M, 2G)"),
         as_json: bool = typer.Option(False, "--json", help="{id, to, files, bytes}")) -> None:
    """Copy a run's remote dir (its log, outputs manifest and what the job left there) here; a multi-node
    run's, a folder per node (node-RANK/)."""
    from .. import runflow
    from ..runflow import fetching

    ws = workspace()
    store = read_store(ws)
    rid = parse_run_id(run_id)
    nodes = store.nodes_of(rid)
    limit = fetching.parse_size(max_size)
    if nodes and nodes[0].id == rid:  # a multi-node run: each node's dir in a folder of its own, node-RANK/
        head = nodes[0]
        to = to or ws.runs_dir / str(head.id) / "pulled"
        pulled = []
        for n in nodes:
            run = runflow.open_run(ws, store, n, inventory(ws), any_spec=True)
            done = fetching.pull(run, to / f"node-{n.node_rank or 0}", limit)
            pulled.append({"rank": n.node_rank or 0, "id": n.id, "to": str(done.to), "files": done.files,
                           "bytes": done.size})
            if not as_json:
                err.print(f"run {head.id} node {n.node_rank or 0}: {done.files} files, {done.size} bytes from "
                          f"{run.host.name}:{run.paths.root}")
        if as_json:
            emit_json({"id": head.id, "to": str(to), "files": sum(p["files"] for p in pulled),
                       "bytes": sum(p["bytes"] for p in pulled), "nodes": pulled})
        else:
            out.print(str(to))
        return
    run = runflow.open_run(ws, store, rid, inventory(ws), any_spec=True)
    done = fetching.pull(run, to or ws.runs_dir / str(run.run_id) / "pulled", limit)
    if as_json:
        emit_json({"id": run.run_id, "to": str(done.to), "files": done.files, "bytes": done.size})
    else:
        err.print(f"run {run.run_id}: {done.files} files, {done.size} bytes from {run.host.name}:{run.paths.root}")
        out.print(str(done.to))


@app.command(epilog="Examples:\n\n  orch ssh 7\n\n  orch ssh 7 --print\n\n  orch ssh 7 --command 'ls -l'")
def ssh(run_id: str = typer.Argument(..., metavar="ID"),
        show: bool = typer.Option(False, "--print", help="print the ssh command instead of running it"),
        command: str | None = typer.Option(None, "--command", "-c", metavar="CMD",
                                           help="run CMD in the run dir instead of a shell")) -> None:
    """Open a login shell on the run's host, in its run dir."""
    import os

    from ..runflow import fetching

    ws = workspace()
    run = read_store(ws).get_run(parse_run_id(run_id))
    if not run.remote_dir:
        raise UsageError(f"run {run.id} has no run dir: it never reached its host")
    argv = fetching.ssh_command(inventory(ws).get(run.host), run.remote_dir, command)
    if show:
        out.print(shlex.join(argv))
        return
    sys.stdout.flush()
    os.execvp(argv[0], argv)  # the shell is the person's now: ssh's exit status is ours
