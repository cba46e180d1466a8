"""Leases and run dirs on the host itself, so that workspaces sharing a host's workdir never hold the same
GPUs nor touch each other's runs.

The SQLite lease (lease.py) keeps the runs of one workspace apart; another workspace's database cannot
see it. So before GPU cleanup a run also takes, under an flock in `<workdir>/leases/`, one file per key —
`host` for the whole host, `gpu-N` per GPU of its set — naming its run token (workspace and run), its run
dir and when it was taken. Another workspace's file stands while its run can still be alive: its run
prepares (no pid yet, under an hour old) or its wrapper lives, and its run dir holds its token without an
exit code. The same call makes the run dir the run's own (its token in `.orch/token`), before anything
else touches the host; removing, adopting or signalling a run's job checks that token first.

The work is done on the host by `hostjobs/leases.py`, which parses what it reads strictly and refuses
symlinks: any member of a shared workdir's group can write there.
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path
from typing import Any

from . import agent
from .errors import OrchError
from .launch import RunPaths
from .remote import Transport
from .store import Store
from .workspace import Workspace

DIR = "leases"
PROGRAM = Path(__file__).resolve().parent / "hostjobs" / "leases.py"
PROGRAM_DIR = "runs/hostjobs"
LOCK_WAIT_S = 30.0  # how long a change waits for `leases/.lock` before naming who holds it


class HostLeaseBusy(OrchError):
    """Another workspace's run holds the host or some of the GPUs here."""


class Refused(OrchError):
    """The host's files are not safe to use: a symlink, another user's folder, another run's dir."""


def keys(gpus: list[int] | None) -> list[str]:
    return ["host"] if gpus is None else [f"gpu-{i}" for i in sorted(gpus)]


def run_token(ws: Workspace, store: Store, run_id: int) -> str:
    """Names this run of this workspace in its remote dir, so another workspace's run N is not taken for it."""
    created = store.conn.execute("SELECT created_at FROM runs WHERE id = ?", (run_id,)).fetchone()
    return f"{socket.gethostname()}:{ws.db_path}:{run_id}:{created[0] if created else 0}"


def workspace_of(token: str) -> str:
    """The workspace part of a run token (`hostname:db path:run id:created`)."""
    return token.rsplit(":", 2)[0]


def workspace_key(ws: Workspace) -> str:
    """A short name of this workspace for its run dirs on shared hosts (`<workdir>/runs/<key>/<id>`)."""
    return hashlib.sha256(f"{socket.gethostname()}:{ws.db_path}".encode()).hexdigest()[:12]


def run_paths(ws: Workspace, workdir: str, run_id: int) -> RunPaths:
    """A run's dir on a host: keyed by workspace as well as id, unless the workdir is the workspace itself
    (the local host), which no other workspace uses."""
    own = workdir.rstrip("/") == str(ws.root).rstrip("/")
    return RunPaths.for_run(workdir, run_id, None if own else workspace_key(ws))


def _call(transport: Transport, request: dict[str, Any]) -> dict[str, Any]:
    request = {"workdir": transport.expand(transport.host.workdir).rstrip("/"),
               "shared": transport.host.shared_workdir, "lock_wait_s": LOCK_WAIT_S, **request}
    return agent.program(transport, PROGRAM, PROGRAM_DIR, request, timeout=90)


def take(transport: Transport, paths: RunPaths, token: str, gpus: list[int] | None, exclusive: bool = True
         ) -> list[str]:
    """Make the run dir the run's and, when exclusive, take the host's lease files for it; or refuse
    (HostLeaseBusy, Refused) naming who holds what. Returns warnings (lease files ignored)."""
    reply = _call(transport, {"action": "take", "run_dir": paths.root, "token": token,
                              "keys": keys(gpus) if exclusive else []})
    if reply.get("ok"):
        return [str(w) for w in reply.get("warnings", [])]
    error = reply.get("error") or {}
    what = "the host" if gpus is None else f"GPUs {','.join(map(str, gpus))}"
    name = transport.host.name
    kind = error.get("kind")
    if kind == "held":
        raise HostLeaseBusy(f"{name}: {what} held by another workspace's run ({error.get('key')}: run dir "
                            f"{error.get('run_dir')}, {error.get('token')}, {error.get('why')}); choose other "
                            "GPUs or a workdir of this workspace's own")
    if kind == "lock-busy":
        raise HostLeaseBusy(f"{name}: cannot take {what}: {error.get('message')}")
    raise Refused(f"{name}: {error.get('message') or 'the host program gave no reason'}")


def release(transport: Transport, token: str) -> None:
    """Remove this run's lease files (those naming its token)."""
    reply = _call(transport, {"action": "release", "token": token})
    if not reply.get("ok"):
        raise OrchError(f"{transport.host.name}: lease files not released: {(reply.get('error') or {}).get('message')}")


def owner(transport: Transport, paths: RunPaths, token: str) -> str:
    """Whose the run dir is: `mine`, `other`, `none` (no token) or `missing`; refused dirs raise."""
    reply = _call(transport, {"action": "owner", "run_dir": paths.root, "token": token})
    if not reply.get("ok"):
        raise Refused(f"{transport.host.name}: {(reply.get('error') or {}).get('message')}")
    return str(reply["owner"])


def remove(transport: Transport, paths: RunPaths, token: str) -> str:
    """Delete the run dir if it is this run's (under the workdir's runs/, holding its token); in words."""
    reply = _call(transport, {"action": "remove", "run_dir": paths.root, "token": token})
    if not reply.get("ok"):
        raise Refused(f"{transport.host.name}: {(reply.get('error') or {}).get('message')}")
    return "removed" if reply.get("removed") else str(reply.get("why"))


__all__ = ["HostLeaseBusy", "Refused", "keys", "owner", "release", "remove", "run_paths",
           "run_token", "take", "workspace_key"]
