"""orch's host side on a host: the `hostjobs` package, shipped as one archive (hostjobs/boot.py), where it is
placed and how it is started.

The archive is uploaded once per version, named by its content hash, under the host's workdir. That folder
may be shared with other users, so the file found there is never simply run: the bootstrap reads it once,
checks its sha256 against the version this orch ships and imports the package from exactly the bytes it
checked — a file swapped by someone else is uploaded again, never run. The upload goes to a fresh name
renamed into place, so a symlink planted at the final name is replaced, not written through.

The agent (`hostjobs.main`) is started through the bootstrap; the patcher, which must run under the run's
own python, is the same archive's `patch` entry, started by the agent's `program` op with no shell in
between (`agent.program`).
"""

from __future__ import annotations

import hashlib
import posixpath
from pathlib import Path

from .hostjobs import boot
from .remote import Transport, quote

MISSING = boot.MISSING
BOOTSTRAP = boot.BOOTSTRAP
SOURCES_RUN = boot.SOURCES_RUN
FOLDER = "runs/hostjobs"  # under the host's workdir
TIMEOUT_S = 120.0  # a program run given no timeout of its own
TOP = str(Path(boot.__file__).resolve().parents[3])  # the folder holding `orchestrator/`, for SOURCES_RUN


def archive() -> bytes:
    """The host side as this orch ships it: the same sources give the same bytes. Made afresh each time
    (16 small files), so it always matches what an agent started from these sources reports."""
    return boot.archive()


def digest() -> str:
    return hashlib.sha256(archive()).hexdigest()


def remote_path(transport: Transport) -> str:
    """Where this version of the archive lives on the host."""
    workdir = transport.expand(transport.host.workdir).rstrip("/")
    return f"{workdir}/{FOLDER}/hostjobs-{digest()[:16]}.zip"


def upload(transport: Transport, path: str) -> None:
    """Place the archive: the transport writes a fresh name and renames it into place, so a symlink
    planted at the final name is replaced, never written through."""
    transport.put(archive(), path, 0o644)
    if transport.host.shared_workdir:
        share_folders(transport, path)


def share_folders(transport: Transport, path: str) -> None:
    """In a shared workdir, the folders the upload may have made (`runs/` and the archive's folder) are
    the group's to write in and keep the group (setgid), whoever made them first: the other users place
    their own versions there and make their run dirs; `runs/` is sticky too, so nobody renames another
    user's run dirs (the archive's folder is not: a file planted there at a later version's name must stay
    replaceable). Only this user's folders (none a symlink) are changed."""
    workdir = transport.expand(transport.host.workdir).rstrip("/")
    folders = ((f"{workdir}/runs", "g+rwxs,+t"), (posixpath.dirname(path), "g+rwxs"))
    transport.run("; ".join(f"if [ -O {quote(d)} ] && [ ! -L {quote(d)} ]; then chmod {mode} {quote(d)}; fi"
                            for d, mode in folders), timeout=60)
