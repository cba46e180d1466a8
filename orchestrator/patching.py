"""Patch sets: small, reviewed diffs applied to an engine's installed source on a host, and undone.

A patch set is a folder `<name>/` (in a folder of sets the registry knows) holding `patch.toml` and one or more unified
diffs (`*.diff` or `*.patch`, applied in name order). Paths in the diff headers, after removing
`strip` leading components (`--- a/sglang/srt/models/deepseek_v2.py` with strip 1), are relative to
the directory that holds the package's top-level folder — site-packages for an ordinary install —
so one diff serves every host whatever its python prefix.

patch.toml:

    description = "what the set does and why"          # required
    package = "sglang"                                  # import name of the top-level package
    distribution = "sglang"                             # optional; for the version, default: package
    versions = "==0.5.23"                               # clauses: == != >= <= > <, comma = and
    strip = 1                                           # optional, default 1
    requires_flags = ["--cuda-graph-backend-decode=disabled"]  # the engine must run with these
    revert_after = true                                 # undo when the run that applied it ends

The work on the host is done by `hostjobs/patcher.py` (package data), run with the host's python: it finds the
package there, checks every hunk of every file before writing anything, writes all files or none, and
keeps the originals so that a revert restores them byte for byte.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import tomllib
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import RemoteError, UsageError
from .remote import Transport, quote
from .store import Store

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
# What the host-side comparator understands: `==0.5.23`, `>=0.4.0,<0.5` (comma means "and").
VERSION_CLAUSE = r"(==|!=|>=|<=|>|<)\s*[0-9][^,\s]*"
DIFF_SUFFIXES = (".diff", ".patch")
# Where, under the host's workdir, the patcher script and the per-set state live.
REMOTE_DIR = "patches"
STATE_DIR = "patches/state"
# The patcher's exit status when its script is not on the host yet (it is then uploaded, once).
SCRIPT_MISSING = 97
# Longest base64 request sent inside the command; the kernel caps one argument at 128 KiB.
INLINE_REQUEST_LIMIT = 64 * 1024
PATCHER = Path(__file__).resolve().parent / "hostjobs" / "patcher.py"  # runs on the host


class PatchError(UsageError):
    """A patch set that does not apply, is unknown, is malformed, or whose files changed since."""


# --- patch sets ----------------------------------------------------------------------------------


class PatchToml(BaseModel):
    """The schema of patch.toml; unknown keys are refused so a typo cannot silently do nothing."""

    model_config = ConfigDict(extra="forbid")

    description: str = Field(min_length=1)
    package: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    distribution: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
    versions: str = Field(pattern=rf"^\s*{VERSION_CLAUSE}(\s*,\s*{VERSION_CLAUSE})*\s*$")
    strip: int = Field(default=1, ge=0)
    requires_flags: list[str] = []
    revert_after: bool = False


@dataclass(frozen=True)
class PatchSet:
    name: str
    package: str
    versions: str
    strip: int
    description: str
    requires_flags: tuple[str, ...]
    revert_after: bool
    files: dict[str, str]  # target path relative to the package root → that file's diff
    set_hash: str
    distribution: str | None = None
    path: Path | None = None


def set_names(directory: Path) -> list[str]:
    """The patch sets in a folder of patch sets (each a folder with a patch.toml)."""
    if not directory.is_dir():
        return []
    return [p.name for p in sorted(directory.iterdir()) if (p / "patch.toml").is_file()]


def load(name: str, base: Path) -> PatchSet:
    """The patch set `name` of the folder of patch sets `base`."""
    folder = base / name
    if not re.fullmatch(NAME_PATTERN, name) or not (folder / "patch.toml").is_file():
        known = sorted(p.name for p in base.iterdir() if (p / "patch.toml").is_file()) if base.is_dir() else []
        raise PatchError(f"unknown patch set {name!r} (known: {', '.join(known) or 'none'})")
    toml_bytes = (folder / "patch.toml").read_bytes()
    try:
        meta = PatchToml(**tomllib.loads(toml_bytes.decode()))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PatchError(f"{folder / 'patch.toml'}: invalid TOML: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'patch.toml'}: {e['msg']}" for e in exc.errors())
        raise PatchError(f"{folder / 'patch.toml'}: {problems}") from None
    diffs = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in DIFF_SUFFIXES)
    if not diffs:
        raise PatchError(f"patch set {name}: no *.diff or *.patch files in {folder}")
    files: dict[str, str] = {}
    for diff in diffs:
        for target, text in split_diff(diff.read_text(), meta.strip, diff.name).items():
            if target in files:
                raise PatchError(f"patch set {name}: {target} is patched by more than one diff")
            files[target] = text
    return PatchSet(
        name=name,
        package=meta.package,
        versions=meta.versions.strip(),
        strip=meta.strip,
        description=meta.description.strip(),
        requires_flags=tuple(meta.requires_flags),
        revert_after=meta.revert_after,
        files=files,
        set_hash=set_hash(toml_bytes, [(d.name, d.read_bytes()) for d in diffs]),
        distribution=meta.distribution,
        path=folder,
    )


def set_hash(toml_bytes: bytes, diffs: Iterable[tuple[str, bytes]]) -> str:
    """sha256 over patch.toml and every diff with its name, so any edit gives a new hash."""
    h = hashlib.sha256()
    for name, data in [("patch.toml", toml_bytes), *sorted(diffs)]:
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return h.hexdigest()


def split_diff(text: str, strip: int, source: str) -> dict[str, str]:
    """One diff text per target file, keyed by its path after `strip`; refuses unsafe paths."""
    sections: list[list[str]] = []
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            sections.append([])
        if sections:
            sections[-1].append(line)
    if not sections:
        raise PatchError(f"{source}: not a unified diff (no ---/+++ header)")
    out: dict[str, str] = {}
    for section in sections:
        target = _header_target(section[1], strip, source)
        if target in out:
            raise PatchError(f"{source}: {target} appears twice")
        out[target] = "".join(section)
    return out


def _header_target(line: str, strip: int, source: str) -> str:
    name = line[4:].split("\t")[0].strip().strip('"')
    parts = [p for p in name.split("/") if p]
    if name == "/dev/null" or len(parts) <= strip:
        raise PatchError(f"{source}: {name!r} is not a file to patch (new and deleted files are not supported)")
    target = parts[strip:]
    if name.startswith("/") and strip == 0 or any(p in (".", "..") for p in target):
        raise PatchError(f"{source}: refusing unsafe path {name!r}")
    return "/".join(target)


def missing_flags(ps: PatchSet, argv: Sequence[str]) -> list[str]:
    """The set's required flags absent from an engine command line (`--f=v` and `--f v` both count)."""
    given = set(argv)
    given |= {f"{a}={b}" for a, b in itertools.pairwise(argv) if a.startswith("--") and not b.startswith("--")}
    return [flag for flag in ps.requires_flags if flag not in given]


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


def check(transport: Transport, ps: PatchSet) -> PatchResult:
    """Would the set apply (or is it already applied) on this host? Changes nothing."""
    return _result(transport, ps.name, "check", _call(transport, _request(transport, ps, "check")))


def apply(
    transport: Transport, ps: PatchSet, *, run_id: int | None = None, store: Store | None = None
) -> PatchResult:
    """Apply every file of the set or none; a set already applied and intact is left as it is."""
    reply = _call(transport, _request(transport, ps, "apply", run_id=run_id))
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
) -> PatchResult:
    """Restore the original bytes of every patched file.

    Refuses, naming the file, when a file changed since it was patched; `force` restores the saved
    original anyway (which, after a reinstall of the package, puts back the old file).
    """
    name = ps if isinstance(ps, str) else ps.name
    if not re.fullmatch(NAME_PATTERN, name):
        raise PatchError(f"invalid patch set name {name!r}")
    request = {"action": "revert", "set_name": name, "force": force, "state_dir": _state_dir(transport)}
    if isinstance(ps, PatchSet):
        request.update(package=ps.package, set_hash=ps.set_hash)
    result = _result(transport, name, "revert", _call(transport, request))
    _record(store, result, run_id)
    return result


def status(transport: Transport, known: Iterable[PatchSet] = (), store: Store | None = None) -> list[AppliedSet]:
    """The sets applied on this host, by which run, and whether their files still match the `known` sets."""
    reply = _call(transport, {"action": "status", "state_dir": _state_dir(transport)})
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


def _state_dir(transport: Transport) -> str:
    return f"{_workdir(transport)}/{STATE_DIR}"


def _request(transport: Transport, ps: PatchSet, action: str, run_id: int | None = None) -> dict[str, Any]:
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
        "state_dir": _state_dir(transport),
        "run_id": run_id,
    }


def _call(transport: Transport, request: dict[str, Any]) -> dict[str, Any]:
    """Run the patcher on the host with `request` and return its reply; refusals raise PatchError.

    One round trip in the usual case: the script is named by its content hash and uploaded only when
    the host lacks that version, and the request goes in a heredoc as base64 (nothing in it reaches
    the shell). A request too long for one command line is uploaded as a file instead.
    """
    script_bytes = PATCHER.read_bytes()
    remote = f"{_workdir(transport)}/{REMOTE_DIR}"
    script = f"{remote}/patcher-{hashlib.sha256(script_bytes).hexdigest()[:16]}.py"
    payload = base64.encodebytes(json.dumps(request).encode()).decode()
    request_file = None
    if len(payload) > INLINE_REQUEST_LIMIT:
        request_file = f"{remote}/request-{uuid.uuid4().hex}.json"
        transport.put(json.dumps(request).encode(), request_file, 0o600)
        feed = f"< {quote(request_file)}; rc=$?; rm -f {quote(request_file)}; exit $rc"
    else:
        feed = f"<<'ORCH_PATCH_REQUEST'\n{payload}ORCH_PATCH_REQUEST\n"
    python = quote(transport.host.python)
    command = f"test -f {quote(script)} || exit {SCRIPT_MISSING}; {python} {quote(script)} {feed}"
    result = transport.run(command, check=False)
    if result.exit_code == SCRIPT_MISSING and not result.stdout:
        transport.put(script_bytes, script, 0o644)
        result = transport.run(command, check=False)
    try:
        reply = json.loads(result.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        if request_file:
            transport.run(f"rm -f {quote(request_file)}", check=False)
        raise RemoteError(
            transport.host.name, command[:200], result.exit_code, result.stdout + result.stderr,
            reason="the patcher gave no reply",
        ) from None
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
    "PatchError",
    "PatchResult",
    "PatchSet",
    "apply",
    "check",
    "load",
    "missing_flags",
    "revert",
    "set_names",
    "status",
]
