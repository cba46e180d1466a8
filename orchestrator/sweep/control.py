"""The sweep's commands: run (or resume) it here, run it in the background, cancel it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import runflow
from ..config.workspace import Workspace
from ..errors import OrchError, UsageError
from ..store import Store
from ..store import sweeps as stored_sweeps
from ..store.record import KILL_GRACE_S
from . import db, notification, policy
from .plan import identity, plan
from .record import Fault, PointStatus, SweepRow, SweepStatus

FINISHED_FOR_GOOD = (PointStatus.SUCCEEDED, PointStatus.PRUNED, PointStatus.INFEASIBLE)
from .runner import Runner
from .status import document

# the directory that holds the orchestrator package, for a background controller's PYTHONPATH
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent


def on_sweep_finished(store: Store, sweep_id: int) -> None:
    """Called when a sweep finishes (whatever its outcome): an event, and the notification."""
    row = db.sweep(store, sweep_id)
    stored_sweeps.add_event(store, sweep_id, "finished", row.status.value, {"notify": row.notify})
    notification.announce(store, sweep_id, document(store, sweep_id))


def _finish(store: Store, sweep_id: int, searched: bool = False) -> dict[str, Any]:
    with store.tx():
        if db.sweep(store, sweep_id).status is not SweepStatus.CANCELLED:  # a cancelled one stays so
            if searched:  # a search's losers and crashes are what it learns from: it succeeded if it found one
                found = document(store, sweep_id)["best"] is not None
                outcome = SweepStatus.SUCCEEDED if found else SweepStatus.FAILED
            else:
                outcome = policy.outcome(pt.status for pt in db.points(store, sweep_id))
            db.transition_sweep(store, sweep_id, outcome)
        db.release(store, sweep_id)
    on_sweep_finished(store, sweep_id)
    return document(store, sweep_id)


def run(ws: Workspace, path: Path, echo: Callable[[str], None] = lambda s: None,
        sleep: Callable[[float], None] = time.sleep, instance: str = "") -> dict[str, Any]:
    """Run (or resume) the sweep in this file (and instance) to its end; returns its status document."""
    store = Store(ws.db_path)
    try:
        p = plan(ws, store, path, instance)
        sweep_id = db.register(store, p)
        db.claim(store, sweep_id)
        done = sum(pt.status in FINISHED_FOR_GOOD or pt.fault is Fault.JOB for pt in db.points(store, sweep_id))
        total = p.search.trials if p.search else len(p.points)
        row = db.sweep(store, sweep_id)
        stored_sweeps.add_event(store, sweep_id, "started",
                     f"controller {row.controller}; {done} of {total} points already done")
        title = f"{p.file.name} {instance}" if instance else p.file.name
        what = f"a search of {total} trials" if p.search else f"{total} points"
        echo(f"sweep {sweep_id} ({title}): {what} on {', '.join(h.name for h in p.hosts)}"
             + (f", {done} already done" if done else ""))
        searcher = None
        if p.search is not None:
            from .search import Searcher  # (Optuna: only a search imports it)

            searcher = Searcher(store, p, sweep_id, echo)
        try:
            Runner(ws, p, sweep_id, echo, sleep, searcher).run()
        except KeyboardInterrupt:
            stored_sweeps.add_event(store, sweep_id, "interrupted", "controller interrupted; running the file again resumes")
            raise
        return _finish(store, sweep_id, searched=p.search is not None)
    finally:
        store.close()


def detach(ws: Workspace, path: Path, instance: str = "") -> tuple[int, Path]:
    """Validate and register the sweep, then run its controller as a background process."""
    store = Store(ws.db_path)
    try:
        p = plan(ws, store, path, instance)
        sweep_id = db.register(store, p)
        db.check_not_running(db.sweep(store, sweep_id))
    finally:
        store.close()
    log = ws.runs_dir / "sweeps" / str(sweep_id) / "controller.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ORCH_HOME": str(ws.root),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))}
    # -P: nothing in the folder orch was started from is imported (a planted `hashlib.py`)
    argv = [sys.executable, "-P", "-m", "orchestrator", "--hosts", str(ws.hosts_file), "sweep", "run", str(p.path),
            "--instance", instance]
    with open(log, "ab") as out:
        # its own session: it outlives this command and the terminal it came from
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)
    return sweep_id, log


def _mark_cancelled(store: Store, sweep_id: int) -> tuple[SweepRow, int]:
    """The sweep and its queued points are cancelled; the row as it was, and how many points."""
    with store.tx():
        row = db.sweep(store, sweep_id)
        if row.status.ended and not row.controller_alive():
            raise OrchError(f"sweep {sweep_id} already ended ({row.status})")
        if row.status is not SweepStatus.CANCELLED:  # cancelled again while its controller winds down
            db.transition_sweep(store, sweep_id, SweepStatus.CANCELLED, "cancelled by user")
        return row, db.cancel_points(store, sweep_id, {PointStatus.QUEUED}, "cancelled by user")


def _end_unattended(store: Store, sweep_id: int) -> None:
    """A cancelled sweep nobody controls: every point not finished is cancelled, and the sweep ends here."""
    with store.tx():
        db.cancel_points(store, sweep_id, {PointStatus.QUEUED, PointStatus.RUNNING}, "cancelled by user")
        db.release(store, sweep_id)


def cancel(ws: Workspace, ref: str, grace_s: float = KILL_GRACE_S) -> dict[str, Any]:
    """Cancel the queued points and stop the running ones."""
    store = Store(ws.db_path)
    try:
        sweep_id = db.resolve(store, ref)
        row, queued = _mark_cancelled(store, sweep_id)
        stopped = {run_id: runflow.stop_quietly(ws, store, run_id, "sweep cancelled", grace_s=grace_s)
                   for run_id in stored_sweeps.active_runs(store, sweep_id)}
        if not row.controller_alive():  # nobody else will end it
            _end_unattended(store, sweep_id)
        stored_sweeps.add_event(store, sweep_id, "cancelled", f"{queued} queued point(s) cancelled, {len(stopped)} run(s) stopped")
        return {"sweep_id": sweep_id, "queued_cancelled": queued, "stopped": stopped}
    finally:
        store.close()


def record_cron_skip(entry_id: str, file: Path, message: str) -> None:
    """A nightly run skipped because the previous one still runs: an event on that sweep."""
    ws = Workspace.find()
    store = Store(ws.db_path)
    try:
        try:
            sweep_id = stored_sweeps.newest(store, *identity(Path(file)))
        except UsageError:
            sweep_id = None
        stored_sweeps.add_event(store, sweep_id, "cron_skip", message, {"entry": entry_id, "file": str(file)})
    finally:
        store.close()
