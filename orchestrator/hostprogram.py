"""Running orch's own host programs (`hostjobs/*.py`: stdlib Python, one JSON request in, one reply out).

A program is uploaded once per version, named by its content hash, under the host's workdir. That folder
may be shared with other users, so the file found there is never simply run: a small bootstrap reads
it, checks its sha256 against the version this orch ships and executes exactly the bytes it checked —
a file swapped by someone else is uploaded again, never run. The upload goes to a fresh name renamed
into place, so a symlink planted at the final name is replaced, not written through.
"""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from pathlib import Path
from typing import Any

from .errors import RemoteError
from .remote import Transport, quote

MISSING = 97  # the bootstrap's exit status when the file is absent or not the expected version
INLINE_REQUEST_LIMIT = 64 * 1024  # the kernel caps one argument at 128 KiB

# argv: the program's path, its sha256, then the program's own arguments. The script's own folder is not
# put on sys.path (as running the file would): nothing there can shadow a module the program imports. The
# program learns the digest of the bytes it runs as ORCH_SHA256 (the agent starts its job wrappers with it).
BOOTSTRAP = (
    "import hashlib, sys\n"
    "p, want = sys.argv[1], sys.argv[2]\n"
    "try:\n"
    "    with open(p, 'rb') as f: code = f.read()\n"
    "except OSError: sys.exit(97)\n"
    "if hashlib.sha256(code).hexdigest() != want: sys.exit(97)\n"
    "sys.argv = [p] + sys.argv[3:]; sys.path[:] = [x for x in sys.path if x]\n"
    "exec(compile(code, p, 'exec'), {'__name__': '__main__', '__file__': p, 'ORCH_SHA256': want})\n"
)


def remote_path(transport: Transport, script: Path, folder: str) -> tuple[str, str]:
    """(path on the host, sha256) of this version of the program."""
    digest = hashlib.sha256(script.read_bytes()).hexdigest()
    workdir = transport.expand(transport.host.workdir).rstrip("/")
    return f"{workdir}/{folder}/{script.stem}-{digest[:16]}.py", digest


def call(transport: Transport, script: Path, folder: str, request: dict[str, Any], *,
         python: str | None = None, pythonpath: str | None = None, timeout: float | None = None) -> dict[str, Any]:
    """Run the program on the host with `request`; its reply (whatever its `ok`). One round trip in the
    usual case; the program is uploaded when the host lacks this version."""
    path, digest = remote_path(transport, script, folder)
    payload = base64.encodebytes(json.dumps(request).encode()).decode()
    request_file = None
    if len(payload) > INLINE_REQUEST_LIMIT:
        request_file = f"{path.rsplit('/', 1)[0]}/request-{uuid.uuid4().hex}.json"
        transport.put(json.dumps(request).encode(), request_file, 0o600)
        # kept for the second try when the program had to be uploaded first
        feed = f"< {quote(request_file)}; rc=$?; [ $rc = {MISSING} ] || rm -f {quote(request_file)}; exit $rc"
    else:
        feed = f"<<'ORCH_HOST_REQUEST'\n{payload}ORCH_HOST_REQUEST\n"
    py = quote(python or transport.host.python)
    if pythonpath is not None:
        py = f"PYTHONPATH={quote(pythonpath)} {py}"
    command = f"{py} -c {quote(BOOTSTRAP)} {quote(path)} {digest} {feed}"
    result = transport.run(command, check=False, timeout=timeout)
    if result.exit_code == MISSING and not result.stdout:
        upload(transport, script, path)
        result = transport.run(command, check=False, timeout=timeout)
    try:
        reply = json.loads(result.stdout.strip().splitlines()[-1])
        if not isinstance(reply, dict):
            raise TypeError(reply)
    except (ValueError, TypeError, IndexError):
        if request_file:
            transport.run(f"rm -f {quote(request_file)}", check=False)
        raise RemoteError(transport.host.name, f"{script.stem} {request.get('action')}", result.exit_code,
                          result.stdout + result.stderr, reason=f"the host program {script.name} gave no reply"
                          ) from None
    return reply


def upload(transport: Transport, script: Path, path: str) -> None:
    """Place the program: the transport writes a fresh name and renames it into place, so a symlink
    planted at the final name is replaced, never written through."""
    transport.put(script.read_bytes(), path, 0o644)
