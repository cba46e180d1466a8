"""Playbooks and patch sets by name: the built-ins by module path, third-party ones by entry points.

A package adds playbooks through the `orch.playbooks` entry-point group (`name = "module:Class"`) and
patch sets through `orch.patch_sets` (`name = "package.with.patch_sets"`: a package whose folders each
hold a patch.toml and its diffs). A built-in name cannot be taken over. The user's own patch sets are folders:
named by their path, or by name from the workspace's `patches/` folder.
"""

from __future__ import annotations

import difflib
import importlib
import re
import sys
from collections.abc import Callable
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from .. import state
from ..config import metricinfo
from ..config.workspace import Workspace
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
WORKSPACE_PATCH_DIR = "patches"  # the workspace's own sets, by name
STATE_FOLDER = re.compile(r"state(-[0-9a-f]{16})?")  # host/patching.py's STATE_DIR and its per-python kin


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _entry_points(group: str) -> dict[str, str]:
    return {ep.name: ep.value for ep in metadata.entry_points(group=group)}


def _playbook_targets() -> dict[str, str]:
    """Looked up once a process (the installed packages are scanned)."""
    held = state.current()
    if held.playbook_targets is None:
        held.playbook_targets = {**_entry_points("orch.playbooks"), **BUILTIN_PLAYBOOKS}
    return held.playbook_targets


def playbook_names() -> list[str]:
    return sorted(_playbook_targets())


def playbook(name: str) -> Playbook[Any]:
    """The playbook called `name`, or a UsageError naming the known ones; loaded once a process."""
    loaded = state.current().playbooks
    if name not in loaded:
        loaded.setdefault(name, _loaded(name))  # two threads may load it: the first one kept is everyone's
    return loaded[name]


def _loaded(name: str) -> Playbook[Any]:
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
    if pb.headlines:
        metricinfo.declare(name, pb.headlines)
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


def _patch_set_dirs() -> dict[str, Path]:
    """Each patch set's name → the folder of sets that holds it (built-ins win a clash); looked up once a
    process."""
    held = state.current()
    if held.patch_set_dirs is None:
        held.patch_set_dirs = _installed_patch_sets()
    return held.patch_set_dirs


def _installed_patch_sets() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in [*_entry_points("orch.patch_sets").values(), BUILTIN_PATCH_SETS]:
        try:
            base = _package_dir(package)
        except (ModuleNotFoundError, TypeError):
            continue  # an uninstalled third-party package: its sets are simply not there
        for name in patching.set_names(base):
            found[name] = base
    return found


def _workspace_sets(root: Path | None) -> dict[str, Path]:
    """The sets in the workspace's own `patches/` folder, each name → its folder. The local host keeps its
    patch state in that folder too (`state`, `state-<hash>`: never sets)."""
    base = (root or Workspace.find().root) / WORKSPACE_PATCH_DIR
    return {name: base / name for name in patching.set_names(base) if not STATE_FOLDER.fullmatch(name)}


def is_folder_ref(ref: str) -> bool:
    """A set named by its folder (`./my-set`, `~/sets/x`, `/abs/x`) rather than by a name."""
    return "/" in ref or ref.startswith(("~", "."))


def patch_set(ref: str, root: Path | None = None) -> PatchSet:
    """The patch set `ref` names: a folder holding patch.toml (relative to the workspace `root`, default the
    current one), or a name — orch's own, an installed package's, or a folder of the workspace's `patches/`.
    Anything else is a PatchError (exit 2) naming the known ones."""
    if is_folder_ref(ref):
        folder = Path(ref).expanduser()
        return patching.load_folder(folder if folder.is_absolute() else (root or Workspace.find().root) / folder)
    dirs = _patch_set_dirs()
    mine = _workspace_sets(root)
    if ref in mine:
        if ref in dirs:
            raise PatchError(f"patch set {ref!r} of {mine[ref].parent} has the name of a set orch already knows "
                             f"({dirs[ref]}); rename its folder")
        return patching.load_folder(mine[ref])
    if ref not in dirs:
        known = sorted({*dirs, *mine})
        raise PatchError(f"unknown patch set {ref!r}{_did_you_mean(ref, known)} "
                         f"(known: {', '.join(known) or 'none'}; a folder of your own: give its path, ./NAME)")
    return patching.load(ref, dirs[ref])


def patch_sets(loadable_only: bool = False, root: Path | None = None) -> list[PatchSet]:
    """Every patch set known by name (the workspace's too); with loadable_only, a malformed one is left out
    instead of raising."""
    sets = []
    for name in sorted({*_patch_set_dirs(), *_workspace_sets(root)}):
        try:
            sets.append(patch_set(name, root))
        except PatchError:
            if not loadable_only:
                raise
    return sets
