"""Playbooks and patch sets by name: the built-ins by module path, third-party ones by entry points.

A package adds playbooks through the `orch.playbooks` entry-point group (`name = "module:Class"`) and
patch sets through `orch.patch_sets` (`name = "package.with.patch_sets"`: a package whose folders each
hold a patch.toml and its diffs). A built-in name cannot be taken over.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import sys
from collections.abc import Callable
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..host import patching
from ..host.patching import PatchError, PatchSet
from ..playbook import Playbook

BUILTIN_PLAYBOOKS = {
    "command": "playbooks.command:Command",
    "extract-hidden-states": "playbooks.extract_hidden_states:ExtractHiddenStates",
    "serve-eagle3": "playbooks.serve_eagle3:ServeEagle3",
    "serve-vllm": "playbooks.serve_vllm:ServeVllm",
    "bench-serving": "playbooks.bench_serving:BenchServing",
    "serve-bench": "playbooks.serve_bench:ServeBench",
    "serve-bench-vllm": "playbooks.serve_bench:ServeBenchVllm",
    "train-draft": "playbooks.train_draft:TrainDraft",
}
BUILTIN_PATCH_SETS = "playbooks.patches"


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _entry_points(group: str) -> dict[str, str]:
    return {ep.name: ep.value for ep in metadata.entry_points(group=group)}


@functools.cache
def _playbook_targets() -> dict[str, str]:
    return {**_entry_points("orch.playbooks"), **BUILTIN_PLAYBOOKS}


def playbook_names() -> list[str]:
    return sorted(_playbook_targets())


@functools.cache
def playbook(name: str) -> Playbook[Any]:
    """The playbook called `name`, or a UsageError naming the known ones."""
    targets = _playbook_targets()
    if name not in targets:
        raise UsageError(f"unknown playbook {name!r}{_did_you_mean(name, targets)} (known: {', '.join(sorted(targets))})")
    if name in BUILTIN_PLAYBOOKS:  # orch's own: one that fails to load is a bug, with its traceback
        pb = _load(targets[name])()
    else:
        # a third party's package may be broken or half-installed: said in one line, orch goes on
        try:
            pb = _load(targets[name])()
        except Exception as exc:  # noqa: BLE001 - whatever its import or constructor raises
            what = " ".join(str(exc).split())[:300]
            raise UsageError(f"playbook {name!r} ({targets[name]}) cannot be loaded: {type(exc).__name__}"
                             + (f": {what}" if what else "")) from None
    if not isinstance(pb, Playbook) or getattr(pb, "name", None) != name:
        raise UsageError(f"playbook {name!r} ({targets[name]}) is not a Playbook named {name!r}")
    return pb


def playbooks(on_broken: Callable[[str], None] | None = None) -> list[Playbook[Any]]:
    """Every playbook; with on_broken, one that cannot be loaded is left out and its error told to it."""
    found = []
    for name in playbook_names():
        try:
            found.append(playbook(name))
        except UsageError as exc:
            if on_broken is None:
                raise
            on_broken(str(exc))
    return found


def summary(pb: Playbook[Any]) -> str:
    """One line on what a playbook does: its module's docstring (or its class's), without the name prefix."""
    doc = sys.modules[type(pb).__module__].__doc__ or type(pb).__doc__ or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    return first.removeprefix(f"`{pb.name}`:").strip()


def _did_you_mean(word: str, known: Any) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


# patch sets ------------------------------------------------------------------------------------
def _package_dir(package: str) -> Path:
    return Path(str(resources.files(package)))


def builtin_patch_dir() -> Path:
    return _package_dir(BUILTIN_PATCH_SETS)


@functools.cache
def _patch_set_dirs() -> dict[str, Path]:
    """Each patch set's name → the folder of sets that holds it (built-ins win a clash)."""
    found: dict[str, Path] = {}
    for package in [*_entry_points("orch.patch_sets").values(), BUILTIN_PATCH_SETS]:
        try:
            base = _package_dir(package)
        except (ModuleNotFoundError, TypeError):
            continue  # an uninstalled third-party package: its sets are simply not there
        for name in patching.set_names(base):
            found[name] = base
    return found


def patch_set(name: str) -> PatchSet:
    """The patch set called `name`, or a PatchError (exit 2) naming the known ones."""
    dirs = _patch_set_dirs()
    if name not in dirs:
        raise PatchError(f"unknown patch set {name!r}{_did_you_mean(name, dirs)} "
                         f"(known: {', '.join(sorted(dirs)) or 'none'})")
    return patching.load(name, dirs[name])


def patch_sets(loadable_only: bool = False) -> list[PatchSet]:
    """Every patch set; with loadable_only, a malformed one is left out instead of raising."""
    sets = []
    for name in sorted(_patch_set_dirs()):
        try:
            sets.append(patch_set(name))
        except PatchError:
            if not loadable_only:
                raise
    return sets
