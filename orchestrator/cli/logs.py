"""Commands on a run's log and run dir: logs, pull, ssh."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import typer

from ..errors import UsageError
from .app import app, inventory, parse_run_id, read_store, workspace
from .render import emit_json, err, out


@app.command(epilog="Examples:\n\n  orch logs 7 -n 200\n\n  orch logs 7 -f\n\n  orch logs 7 --all > run7.log")
def logs(
    run_id: str = typer.Argument(..., metavar="ID"),
    lines: int = typer.Option(40, "-n", "--lines", metavar="N"),
    whole: bool = typer.Option(False, "--all", help="the whole log from the host, streamed"),
    follow: bool = typer.Option(False, "-f", "--follow", help="print new lines as they come, until the job ends"),
    as_json: bool = typer.Option(False, "--json", help="{run_id, source, note, lines}"),
) -> None:
    """Print the last lines of a run's log: from its host, or the tail kept locally when the host is down."""
    from .. import runflow

    ws = workspace()
    store = read_store(ws)
    rid = parse_run_id(run_id)
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


def _whole_log(ctx: Any) -> None:
    from ..runflow import fetching

    _stream(lambda write: fetching.stream_log(ctx, write))


@app.command(epilog="Examples:\n\n  orch pull 7\n\n  orch pull 7 --to results/run7 --max-size 4G")
def pull(run_id: str = typer.Argument(..., metavar="ID"),
         to: Path | None = typer.Option(None, "--to", metavar="DIR", help="default: runs/<id>/pulled"),
         max_size: str = typer.Option("1G", "--max-size", metavar="SIZE", help="copy nothing above this (512M, 2G)"),
         as_json: bool = typer.Option(False, "--json", help="{id, to, files, bytes}")) -> None:
    """Copy a run's remote dir (its log, outputs manifest and what the job left there) here."""
    from .. import runflow
    from ..runflow import fetching

    ws = workspace()
    store = read_store(ws)
    ctx = runflow.open_run(ws, store, parse_run_id(run_id), inventory(ws), any_spec=True)
    limit = fetching.parse_size(max_size)
    done = fetching.pull(ctx, to or ws.runs_dir / str(ctx.run_id) / "pulled", limit)
    if as_json:
        emit_json({"id": ctx.run_id, "to": str(done.to), "files": done.files, "bytes": done.size})
    else:
        err.print(f"run {ctx.run_id}: {done.files} files, {done.size} bytes from {ctx.host.name}:{ctx.paths.root}")
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
