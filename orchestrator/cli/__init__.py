"""The `orch` command: parse, call one library function, render, choose the exit code (in `main`)."""

from __future__ import annotations

import functools
import sys

import typer

from ..config.workspace import owner_only
from ..errors import OrchError
from ..host import session
from .app import app
from .render import err


@functools.cache
def _command() -> typer.core.TyperGroup:
    """The click command Typer builds from the app: once per process, however many commands it runs."""
    return typer.main.get_command(app)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> None:
    """Exit codes in one place: 0 ok, 1 the run failed or an operation failed, 2 bad input.

    Typer's standalone mode already maps usage errors to 2 and typer.Exit to its code; OrchErrors
    become one message without a traceback; anything else is a bug and keeps its traceback.
    """
    command = _command()
    args = sys.argv[1:] if argv is None else argv
    session.current().quiet_retries = "--json" in args
    for n, arg in enumerate(args, 1):  # names, notes, specs and paths are kept as UTF-8 text
        try:
            arg.encode()
        except UnicodeEncodeError:
            shown = repr(arg.encode(errors="surrogateescape"))[1:]
            err.print(f"orch: argument {n} is not UTF-8 text: {shown}", markup=False)
            sys.exit(2)
    try:
        with owner_only():  # what it writes on this machine is its user's alone, whatever the umask
            command.main(args=argv, prog_name="orch", standalone_mode=True)
    except OrchError as exc:
        first, *rest = str(exc).splitlines() or [type(exc).__name__]
        err.print(f"orch: {first}", markup=False)
        for line in rest:
            err.print(f"  {line}", markup=False)
        sys.exit(exc.exit_code)
    finally:
        if "orchestrator.host.remote" in sys.modules:  # connections to close (a command that made none skips the import)
            sys.modules["orchestrator.host.remote"].close_all()
        if "orchestrator.runflow.notify" in sys.modules:  # notifications still being sent: a bounded wait
            sys.modules["orchestrator.runflow.notify"].drain()


__all__ = ["app", "main"]
