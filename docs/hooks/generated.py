"""MkDocs hook: the parts of the manual the code already says, written out when the manual is built so
they never go stale. A page asks for one with a line `<!-- generated: NAME -->`; an unknown NAME fails
the build. Needs orch importable (the `docs` extra installs it with orch)."""

from __future__ import annotations

import re
import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARK = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)


_ESCAPED = {"\\": "\\\\", "`": "\\`", "*": "\\*", "_": "\\_", "[": "\\[", "|": "\\|", "<": "&lt;", ">": "&gt;"}


def _text(value: Any) -> str:
    """Plain text as Markdown shows it as it is: a regex's `*`, a `<run dir>`, a `true|false` in a table."""
    return "".join(_ESCAPED.get(c, c) for c in " ".join(str(value).split()))


def _cell(value: Any) -> str:
    return str(value) if str(value).startswith("`") else (_text(value) or " ")


def _table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fields_table(docs: list[Any]) -> str:
    return _table(["key", "type", "default", "description"],
                  [[f"`{d.name}`", d.type + (f" ({d.bounds})" if d.bounds else ""), d.default_text, d.description]
                   for d in docs])


def playbooks() -> str:
    """orch's own playbooks, each with the keys of its spec beyond the common ones."""
    from orchestrator.config import specdoc
    from orchestrator.config.spec import RunSpec
    from orchestrator.runflow import registry

    common = set(RunSpec.model_fields)
    parts = []
    for name in sorted(registry.BUILTIN_PLAYBOOKS):
        pb = registry.playbook(name)
        own = [d for d in specdoc.fields(pb.Spec) if d.name not in common]
        engine = f"Log format: {pb.engine}." if pb.engine else "Log format: any (read by shape)."
        parts.append(f"### {name}\n\n{_text(registry.summary(pb))} {engine}\n\n"
                     + (_fields_table(own) if own else "No keys beyond the common ones."))
    return "\n\n".join(parts)


def common_fields() -> str:
    """The keys every playbook's spec has."""
    from orchestrator.config import specdoc
    from orchestrator.config.spec import RunSpec

    return _fields_table(specdoc.fields(RunSpec))


def patch_sets() -> str:
    """The patch sets orch ships."""
    from orchestrator.config.patchset import set_names
    from orchestrator.runflow import registry

    with tempfile.TemporaryDirectory() as empty:  # a workspace with no sets of its own
        sets = [registry.patch_set(name, Path(empty)) for name in set_names(registry.builtin_patch_dir())]
    rows = [[f"`{p.name}`", p.distribution or p.package, p.versions or "any", " ".join(p.requires_flags),
             "yes" if p.revert_after else "no", p.description] for p in sets]
    return _table(["name", "package", "versions", "requires", "revert after", "what it does"], rows)


def schema() -> str:
    """Every table and view of a new database, with its columns, as orch's migrations make it."""
    from orchestrator.store.db import Store

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "orch.db"
        Store(path).close()
        conn = sqlite3.connect(path)
        try:
            objects = conn.execute("SELECT type, name FROM sqlite_master WHERE type IN ('table', 'view')"
                                   " AND name NOT LIKE 'sqlite_%' ORDER BY type, name").fetchall()
            rows = []
            for kind, name in objects:
                columns = [c[1] for c in conn.execute(f"PRAGMA table_info([{name}])")]
                rows.append([f"`{name}`", kind, ", ".join(columns)])
        finally:
            conn.close()
    return _table(["name", "kind", "columns"], rows)


GENERATORS: dict[str, Callable[[], str]] = {
    "playbooks": playbooks, "common-fields": common_fields, "patch-sets": patch_sets, "schema": schema,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_path}: no generator called {name!r} (known: {', '.join(GENERATORS)})")
        return GENERATORS[name]()

    return MARK.sub(one, markdown)
