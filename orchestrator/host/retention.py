"""Removing old runs: their records, their local artifacts and their remote run dirs — never an active run."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass

from ..config.hosts import Inventory
from ..config.workspace import Workspace
from ..errors import OrchError, UsageError
from ..store import Store
from ..store.record import ACTIVE, Run
from . import hostlease
from .launch import RunPaths
from .remote import connect


@dataclass
class Removed:
    run_id: int
    remote: str  # what happened to the remote run dir, in words
    ok: bool = True


def check_removable(run: Run) -> None:
    if run.status in ACTIVE:
        raise UsageError(f"run {run.id} is {run.status}: cancel it first (`orch cancel {run.id}`)")
    if run.sweep_id is not None:
        raise UsageError(f"run {run.id} belongs to sweep {run.sweep_id}; its record stays with the sweep")


def older_than(store: Store, seconds: float, now: float | None = None) -> list[Run]:
    """Ended runs, not part of a sweep, that ended (or were created) more than `seconds` ago."""
    cutoff = (now or time.time()) - seconds
    rows = store.conn.execute(
        "SELECT id FROM runs WHERE sweep_id IS NULL AND COALESCE(ended_at, created_at) < ?"
        f" AND status NOT IN ({','.join('?' * len(ACTIVE))}) ORDER BY id", [cutoff, *[s.value for s in ACTIVE]])
    return [store.get_run(run_id) for (run_id,) in rows]


def _remove_remote(ws: Workspace, store: Store, run: Run, inv: Inventory) -> str:
    if not run.remote_dir:
        return "no remote dir"
    if run.host not in inv.hosts:  # the record can still go; what is on that machine is left as it is
        return f"host {run.host} is no longer in the inventory; {run.remote_dir} left there"
    host = inv.get(run.host)
    # only this run's own dir: under the host's <workdir>/runs/, holding this run's token, never a path a
    # record could point anywhere else (the host's program checks both, and refuses symlinks)
    said = hostlease.remove(connect(host), RunPaths(run.remote_dir), hostlease.run_token(ws, store, run.id))
    return f"{'removed' if said == 'removed' else said} {host.name}:{run.remote_dir}"


def remove(ws: Workspace, store: Store, runs: list[Run], inv: Inventory, keep_remote: bool = False) -> list[Removed]:
    """Remove each run (all are checked first); a run whose remote dir cannot be removed keeps its record."""
    for run in runs:
        check_removable(run)
    done = []
    for run in runs:
        try:
            remote = "remote dir kept" if keep_remote else _remove_remote(ws, store, run, inv)
        except OrchError as exc:
            done.append(Removed(run.id, str(exc), ok=False))
            continue
        with store.tx() as c:
            for table in ("events", "metrics", "leases"):
                c.execute(f"DELETE FROM {table} WHERE run_id = ?", (run.id,))
            c.execute("DELETE FROM runs WHERE id = ?", (run.id,))
        shutil.rmtree(ws.runs_dir / str(run.id), ignore_errors=True)
        done.append(Removed(run.id, remote))
    return done
