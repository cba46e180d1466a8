"""Leases and run dirs on the host itself: the host owns its GPUs, so that workspaces sharing a host's
workdir never hold the same GPUs nor touch each other's runs.

Who holds a host: the run whose token the host's lease files name (`<workdir>/leases/host`, or `gpu-N` for
each GPU of a run's set), taken by one `take` request to the host's agent in the transaction that creates
the run (granted under the host's lock, or refused naming the holder, and then no run is made; `--queue`
makes the same request again) and freed by one `release` after the run's end steps. Whether a holder can
still holds is judged on the host alone, for every workspace alike, from what it can prove: its run prepares
(no pid yet, under an hour old), its job runs, or its job ended minutes ago and its end steps run.

A refusal naming a run of this very workspace is handed to store/lease.py as `HeldByRun`, which acts on it
(waits, or has a run nobody is at work on looked at, which ends and releases it); its SQLite table only
remembers what the hosts granted.

The take also makes the run dir the run's own (its token in `.orch/token`, rundirs.claim_run_dir on the host, as the
launch claims it again); removing, adopting or signalling a run's job checks that token first. The work is
done on the host by `hostjobs/leases.py`, an op of the host's agent (no process of its own), which parses
what it reads strictly and refuses symlinks: any member of a shared workdir's group can write there.
"""

from __future__ import annotations

import hashlib
import socket
from typing import Any

from ..config.workspace import Workspace
from ..errors import OrchError
from ..store import Store
from ..store.lease import HeldByRun
from . import agent
from .hostjobs.leases import LEASES as DIR
from .hostjobs.leases import LOCK_WAIT_S, workspace_of
from .launch import RunPaths
from .remote import Transport


class HostLeaseBusy(OrchError):
    """Another workspace's run holds the host or some of the GPUs here (`held`), or the lease lock is
    held for too long."""

    def __init__(self, message: str, held: bool = False):
        super().__init__(message)
        self.held = held


class Refused(OrchError):
    """The host's files are not safe to use: a symlink, another user's folder, another run's dir."""


def keys(gpus: list[int] | None) -> list[str]:
    return ["host"] if gpus is None else [f"gpu-{i}" for i in sorted(gpus)]


def workspace_id(ws: Workspace) -> str:
    """This workspace as run tokens name it (`hostname:db path`)."""
    return f"{socket.gethostname()}:{ws.db_path}"


def run_token(ws: Workspace, store: Store, run_id: int) -> str:
    """Names this run of this workspace in its remote dir, so another workspace's run N is not taken for it."""
    created = store.created_at(run_id)
    return f"{workspace_id(ws)}:{run_id}:{created if created is not None else 0}"


def run_id_of(token: str) -> int | None:
    """The run id a run token names (see run_token), or None when it names none."""
    parts = token.rsplit(":", 2)
    return int(parts[1]) if len(parts) == 3 and token.count(":") >= 3 and parts[1].isdigit() else None


def workspace_key(ws: Workspace) -> str:
    """A short name of this workspace for its run dirs on shared hosts (`<workdir>/runs/<key>/<id>`)."""
    return hashlib.sha256(workspace_id(ws).encode()).hexdigest()[:12]


def run_paths(ws: Workspace, workdir: str, run_id: int) -> RunPaths:
    """A run's dir on a host: keyed by workspace as well as id, unless the workdir is the workspace itself
    (the local host), which no other workspace uses."""
    own = workdir.rstrip("/") == str(ws.root).rstrip("/")
    return RunPaths.for_run(workdir, run_id, None if own else workspace_key(ws))


def _call(transport: Transport, request: dict[str, Any]) -> dict[str, Any]:
    request = {"workdir": transport.expand(transport.host.workdir).rstrip("/"),
               "shared": transport.host.shared_workdir, "lock_wait_s": LOCK_WAIT_S, **request}
    return agent.call(transport, "lease", timeout=LOCK_WAIT_S + 60, **request)


def take(transport: Transport, paths: RunPaths, token: str, gpus: list[int] | None, exclusive: bool = True
         ) -> list[str]:
    """Make the run dir the run's and, when exclusive, take the host's lease files for it; or refuse
    (HostLeaseBusy, Refused) naming who holds what. Returns warnings (lease files ignored)."""
    reply = _call(transport, {"action": "take", "run_dir": paths.root, "token": token,
                              "keys": keys(gpus) if exclusive else []})
    if reply.get("ok"):
        return [str(w) for w in reply.get("warnings", [])]
    raise refused(transport.host.name, token, gpus, reply.get("error") or {})


def refused(name: str, token: str, gpus: list[int] | None, error: dict[str, Any]) -> OrchError:
    """The error for a take the host `name` refused to the run `token`: HeldByRun when a run of the same
    workspace holds what it asked for, HostLeaseBusy for another workspace's, Refused for unsafe files."""
    what = "the host" if gpus is None else f"GPUs {','.join(map(str, gpus))}"
    kind = error.get("kind")
    holder = str(error.get("token") or "")
    holder_id = run_id_of(holder)
    if kind == "held" and holder_id is not None and workspace_of(holder) == workspace_of(token):
        return HeldByRun(holder_id, f"{name}: {what} held by run {holder_id} ({error.get('why')})")
    if kind == "held":
        return HostLeaseBusy(f"{name}: {what} held by another workspace's run ({error.get('key')}: run dir "
                             f"{error.get('run_dir')}, {error.get('token')}, {error.get('why')}); choose other "
                             "GPUs or a workdir of this workspace's own", held=True)
    if kind == "lock-busy":
        return HostLeaseBusy(f"{name}: cannot take {what}: {error.get('message')}")
    return Refused(f"{name}: {error.get('message') or 'the host gave no reason'}")


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


__all__ = ["DIR", "LOCK_WAIT_S", "HostLeaseBusy", "Refused", "keys", "owner", "refused", "release", "remove", "run_id_of", "run_paths",
           "run_token", "take", "workspace_id", "workspace_key", "workspace_of"]
