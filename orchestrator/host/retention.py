"""Removing old runs: their records, their local artifacts and their remote run dirs — never an active run."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass

from ..config.hosts import Inventory
from ..config.workspace import Workspace
from ..errors import OrchError, UsageError
from ..store import Store
from ..store.record import ACTIVE, RunRecord
from . import hostlease
from .launch import RunPaths
from .remote import connect


@dataclass
class Removed:
    run_id: int
    remote: str  # what happened to the remote run dir, in words
    ok: bool = True


def check_removable(run: RunRecord) -> None:
    if run.parent_id is not None:  # a node goes with its run, never alone
        raise UsageError(f"run {run.id} is node {run.node_rank} of run {run.parent_id}: remove the run"
                         f" (`orch rm {run.parent_id}`)")
    if run.status in ACTIVE:
        raise UsageError(f"run {run.id} is {run.status}: cancel it first (`orch cancel {run.id}`)")
    if run.sweep_id is not None:
        raise UsageError(f"run {run.id} belongs to sweep {run.sweep_id}; its record stays with the sweep")


def older_than(store: Store, seconds: float, now: float | None = None) -> list[RunRecord]:
    """Ended runs, not part of a sweep, that ended (or were created) more than `seconds` ago."""
    return store.ended_before((now or time.time()) - seconds)


def _remove_remote(ws: Workspace, store: Store, run: RunRecord, inv: Inventory) -> str:
    if not run.remote_dir:
        return "no remote dir"
    if run.host not in inv.hosts:  # the record can still go; what is on that machine is left as it is
        return f"host {run.host} is no longer in the inventory; {run.remote_dir} left there"
    host = inv.get(run.host)
    # only this run's own dir: under the host's <workdir>/runs/, holding this run's token, never a path a
    # record could point anywhere else (the host's program checks both, and refuses symlinks)
    said = hostlease.remove(connect(host), RunPaths(run.remote_dir), hostlease.run_token(ws, store, run.id))
    return f"{'removed' if said == 'removed' else said} {host.name}:{run.remote_dir}"


def remove(ws: Workspace, store: Store, runs: list[RunRecord], inv: Inventory, keep_remote: bool = False) -> list[Removed]:
    """Remove each run (all are checked first); a run whose remote dir cannot be removed keeps its record."""
    nodes = {run.id: store.nodes_of(run.id) or [run] for run in runs}  # a multi-node run: each of its nodes
    for run in runs:
        check_removable(run)
        for node in nodes[run.id][1:]:
            if node.status in ACTIVE:
                raise UsageError(f"run {run.id}'s node {node.node_rank} (run {node.id}) is {node.status}:"
                                 f" cancel the run first (`orch cancel {run.id}`)")
    done = []
    for run in runs:
        try:
            # each node's dir, on its own host (the head's is the run's); the records go only when all went
            remote = "remote dir kept" if keep_remote else "; ".join(
                _remove_remote(ws, store, n, inv) for n in nodes[run.id])
        except OrchError as exc:
            done.append(Removed(run.id, str(exc), ok=False))
            continue
        store.delete_run(run.id)  # the node records too
        for one in nodes[run.id]:
            shutil.rmtree(ws.runs_dir / str(one.id), ignore_errors=True)
        done.append(Removed(run.id, remote))
    return done
