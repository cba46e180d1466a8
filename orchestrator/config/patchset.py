"""A patch set on disk: patch.toml and its unified diffs, loaded and checked (the patch.toml schema,
which file each diff patches, the set's hash, the flags it requires). See host/patching.py for the format."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import UsageError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
# What the host-side comparator understands: `==0.5.23`, `>=0.4.0,<0.5` (comma means "and").
VERSION_CLAUSE = r"(==|!=|>=|<=|>|<)\s*[0-9][^,\s]*"
DIFF_SUFFIXES = (".diff", ".patch")


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
    ref: str | None = None  # how a spec or a run names a set given by its folder: that folder, absolute

    @property
    def named_as(self) -> str:
        """What a run records to find this set again when it ends: its name, or its folder."""
        return self.ref or self.name


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
    return _read(name, folder)


def load_folder(folder: Path) -> PatchSet:
    """The patch set in `folder` (its patch.toml and diffs), named after the folder."""
    folder = folder.expanduser().resolve()
    if not folder.is_dir():
        raise PatchError(f"no patch set folder {folder}")
    if not (folder / "patch.toml").is_file():
        raise PatchError(f"{folder} is not a patch set: it has no patch.toml")
    if not re.fullmatch(NAME_PATTERN, folder.name):
        raise PatchError(f"{folder}: a patch set folder's name must match {NAME_PATTERN}")
    return dataclasses.replace(_read(folder.name, folder), ref=str(folder))


def _read(name: str, folder: Path) -> PatchSet:
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
        try:
            text_of_diff = diff.read_text()
        except UnicodeDecodeError:
            raise PatchError(f"patch set {name}: {diff} is not a text (UTF-8) diff") from None
        for target, text in split_diff(text_of_diff, meta.strip, diff.name).items():
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
