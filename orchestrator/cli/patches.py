"""orch patch: list, check, apply, revert and status of patch sets."""

from __future__ import annotations

from typing import Any

import typer

from ..config.workspace import LOCAL
from ..store import Store
from .app import app, inventory, open_store, read_store, workspace
from .render import emit_json, out, table

patch_app = typer.Typer(help="Patch sets for the engines' installed source.", no_args_is_help=True)
app.add_typer(patch_app, name="patch")


@patch_app.command("list")
def patch_list(as_json: bool = typer.Option(False, "--json")) -> None:
    """The patch sets orch knows by name: its own, installed packages', the workspace's patches/."""
    from ..runflow import registry

    sets = registry.patch_sets(root=workspace().root)
    rows: list[dict[str, Any]] = [
        {"name": p.name, "package": p.package, "distribution": p.distribution or p.package, "versions": p.versions,
         "files": sorted(p.files), "folder": str(p.path) if p.path else None,
         "requires_flags": list(p.requires_flags), "revert_after": p.revert_after,
         "set_hash": p.set_hash, "description": p.description} for p in sets]
    if as_json:
        emit_json(rows)
        return
    table(["name", "package", "versions", "files", "requires", "revert after"],
          [[r["name"], r["package"], r["versions"], len(r["files"]), " ".join(r["requires_flags"]),
            "yes" if r["revert_after"] else "no"] for r in rows])


def _patch_target(name: str | None, host: str, writes: bool = True) -> tuple[Any, Any, Store]:
    from ..host.remote import connect
    from ..runflow import registry

    ws = workspace()
    target = inventory(ws).get(host)
    ps = registry.patch_set(name, ws.root) if name else None  # a bad set is refused before the host is reached
    return ps, connect(target), open_store(ws) if writes else read_store(ws)


PYTHON = typer.Option(None, "--python", metavar="PATH",
                      help="the interpreter whose install is patched (default: the host's python)")


def _print_patch_result(res: Any, as_json: bool) -> None:
    if as_json:
        import dataclasses

        emit_json(dataclasses.asdict(res))
        return
    out.print(f"{res.set_name} {res.action} on {res.host}: {res.package} {res.version or ''} at {res.root}")
    for f in res.files:
        out.print(f"  {f.state:9} {f.file}")


SET = typer.Argument(..., metavar="SET", help="a patch set's name, or the path of a folder holding its patch.toml "
                     "and diffs (./my-set; relative to the workspace)")


@patch_app.command("check")
def patch_check(name: str = SET, host: str = typer.Option(LOCAL, "--host", "-H"), python: str | None = PYTHON,
                as_json: bool = typer.Option(False, "--json")) -> None:
    """Would the set apply on the host? Changes nothing."""
    from ..host import patching

    ps, transport, _ = _patch_target(name, host, writes=False)
    _print_patch_result(patching.check(transport, ps, python=python), as_json)


@patch_app.command("apply")
def patch_apply(name: str = SET, host: str = typer.Option(LOCAL, "--host", "-H"), python: str | None = PYTHON,
                as_json: bool = typer.Option(False, "--json")) -> None:
    """Apply every file of the set, or none."""
    from ..host import patching

    ps, transport, store = _patch_target(name, host)
    _print_patch_result(patching.apply(transport, ps, store=store, python=python), as_json)


@patch_app.command("revert")
def patch_revert(name: str = SET, host: str = typer.Option(LOCAL, "--host", "-H"), python: str | None = PYTHON,
                 force: bool = typer.Option(False, "--force", help="revert files changed since patching"),
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Restore the original bytes of every file the set patched."""
    from ..host import patching
    from ..runflow import registry

    root = workspace().root
    # A folder must still hold a valid set; a name needs only the host's record (its set may be gone here).
    ps = registry.patch_set(name, root) if registry.is_folder_ref(name) else None
    _, transport, store = _patch_target(None, host)
    known = {p.name: p for p in registry.patch_sets(loadable_only=True, root=root)}
    res = patching.revert(transport, ps or known.get(name) or name, force=force, store=store, python=python)
    _print_patch_result(res, as_json)


@patch_app.command("status")
def patch_status(host: str = typer.Option(LOCAL, "--host", "-H"), python: str | None = PYTHON,
                 as_json: bool = typer.Option(False, "--json")) -> None:
    """Which sets are applied on the host, by which run, and whether the files still match."""
    import dataclasses

    from ..host import patching
    from ..runflow import registry

    _, transport, store = _patch_target(None, host, writes=False)
    applied = patching.status(transport, registry.patch_sets(loadable_only=True, root=workspace().root), store,
                              python=python)
    if as_json:
        emit_json([{**dataclasses.asdict(a), "intact": a.intact} for a in applied])
        return
    if not applied:
        out.print(f"no patch sets applied on {host}" + (f" for {python}" if python else ""))
    for a in applied:
        run = f"run {a.run_id}" if a.run_id else "by hand"
        state = "files match" if a.intact else "FILES CHANGED: " + ", ".join(
            f.file for f in a.files if f.state != "applied")
        out.print(f"{a.set_name} on {a.package} {a.version} at {a.root} ({run}): {state}")


