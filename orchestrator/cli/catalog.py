"""What orch can run: `orch playbooks`, and the spec keys `orch run PLAYBOOK --help` lists."""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer import _click as click  # Typer's own copy of click: its Context and HelpFormatter
from typer.core import TyperCommand

from .app import app
from .render import emit_json, err, out, table


def playbook_fields(name: str) -> list[dict[str, Any]]:
    from ..config import specdoc
    from ..runflow import registry

    return [{"key": d.name, "type": d.type, "default": d.default, "required": d.required,
             "bounds": d.bounds, "description": d.description}
            for d in specdoc.fields(registry.playbook(name).Spec)]


def print_fields(name: str) -> None:
    from ..config import specdoc
    from ..runflow import registry

    pb = registry.playbook(name)
    out.print(f"\n{name}: {registry.summary(pb)}")
    out.print("Spec keys (--set KEY=VALUE, or KEY = VALUE in a -f spec.toml):")
    rows = [[d.name, d.type + (f" ({d.bounds})" if d.bounds else ""), d.default_text, d.description]
            for d in specdoc.fields(pb.Spec)]
    table(["key", "type", "default", "description"], rows)


class RunCommand(TyperCommand):
    """`orch run`: with a playbook named, --help also lists that playbook's spec keys."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        from ..runflow import registry

        names = set(registry.playbook_names())
        ctx.meta["playbook"] = next((a for a in args if a in names), None)
        return super().parse_args(ctx, args)

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help(ctx, formatter)
        name = ctx.meta.get("playbook")
        if name:
            sys.stdout.write(formatter.getvalue())  # the plain (non-Rich) help, before what follows it
            formatter.buffer.clear()
            print_fields(name)
        else:
            out.print("`orch playbooks` lists the playbooks; `orch run PLAYBOOK --help` lists a playbook's spec keys.")


@app.command()
def playbooks(as_json: bool = typer.Option(False, "--json", help="name, summary, engine and spec keys of each")) -> None:
    """The playbooks orch can run: name, what it does, the log format it reads."""
    from ..runflow import registry

    # a plugin that cannot be loaded is named on stderr; the others are listed all the same
    found = registry.playbooks(on_broken=lambda message: err.print(f"orch: {message}", markup=False))
    if as_json:
        emit_json([{"name": pb.name, "summary": registry.summary(pb), "engine": pb.engine,
                    "exclusive": pb.exclusive, "fields": playbook_fields(pb.name)} for pb in found])
        return
    table(["name", "engine", "summary"], [[pb.name, pb.engine or "any", registry.summary(pb)] for pb in found])
