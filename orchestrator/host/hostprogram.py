"""orch's own host programs (`hostjobs/*.py`: stdlib Python, one JSON request in, one reply out): where
they are placed and how their bytes are checked before they run.

A program is uploaded once per version, named by its content hash, under the host's workdir. That folder
may be shared with other users, so the file found there is never simply run: a small bootstrap reads
it, checks its sha256 against the version this orch ships and executes exactly the bytes it checked —
a file swapped by someone else is uploaded again, never run. The upload goes to a fresh name renamed
into place, so a symlink planted at the final name is replaced, not written through.

The agent (hostjobs/agent.py) is started through the bootstrap; the other programs are run by the
agent's `program` op, their request on stdin, with no shell in between (`agent.program`).
"""

from __future__ import annotations

import hashlib
import posixpath
from pathlib import Path

from .remote import Transport, quote

MISSING = 97  # the bootstrap's exit status when the file is absent or not the expected version
TIMEOUT_S = 120.0  # a program run given no timeout of its own

# argv: the program's path, its sha256, then the program's own arguments. Before anything is imported, sys.path
# keeps only absolute folders: neither the folder the program is started in (`-c` puts it first, as '') nor
# the script's own folder can shadow a module it imports (a `hashlib.py` planted in a run dir). The
# program learns the digest of the bytes it runs as ORCH_SHA256 (the agent starts its job wrappers with it).
BOOTSTRAP = (
    "import sys\n"
    "sys.path[:] = [x for x in sys.path if x.startswith('/')]\n"
    "import hashlib\n"
    "p, want = sys.argv[1], sys.argv[2]\n"
    "try:\n"
    "    with open(p, 'rb') as f: code = f.read()\n"
    "except OSError: sys.exit(97)\n"
    "if hashlib.sha256(code).hexdigest() != want: sys.exit(97)\n"
    "sys.argv = [p] + sys.argv[3:]\n"
    "exec(compile(code, p, 'exec'), {'__name__': '__main__', '__file__': p, 'ORCH_SHA256': want})\n"
)


def remote_path(transport: Transport, script: Path, folder: str) -> tuple[str, str]:
    """(path on the host, sha256) of this version of the program."""
    digest = hashlib.sha256(script.read_bytes()).hexdigest()
    workdir = transport.expand(transport.host.workdir).rstrip("/")
    return f"{workdir}/{folder}/{script.stem}-{digest[:16]}.py", digest


def upload(transport: Transport, script: Path, path: str) -> None:
    """Place the program: the transport writes a fresh name and renames it into place, so a symlink
    planted at the final name is replaced, never written through."""
    transport.put(script.read_bytes(), path, 0o644)
    if transport.host.shared_workdir:
        share_folders(transport, path)


def share_folders(transport: Transport, path: str) -> None:
    """In a shared workdir, the folders the upload may have made (`runs/` and the program's folder) are
    the group's to write in and keep the group (setgid), whoever made them first: the other users place
    their own versions there and make their run dirs; `runs/` is sticky too, so nobody renames another
    user's run dirs (the program's folder is not: a file planted there at a later version's name must stay
    replaceable). Only this user's folders (none a symlink) are changed."""
    workdir = transport.expand(transport.host.workdir).rstrip("/")
    folders = ((f"{workdir}/runs", "g+rwxs,+t"), (posixpath.dirname(path), "g+rwxs"))
    transport.run("; ".join(f"if [ -O {quote(d)} ] && [ ! -L {quote(d)} ]; then chmod {mode} {quote(d)}; fi"
                            for d, mode in folders), timeout=60)
