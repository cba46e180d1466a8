"""A run's change of status: `transition()` checks it against the allowed moves (`record.ALLOWED`, beside
the statuses) and writes it, with its fields and its event, in one transaction."""

from __future__ import annotations

import time
from typing import Any

from ..errors import TransitionError
from .db import Store
from .record import ALLOWED, Status


def transition(store: Store, run_id: int, to: Status, message: str = "", **fields: Any) -> None:
    """Move a run to `to`, writing the status, extra run fields and a status event in one transaction."""
    now = time.time()
    with store.tx() as c:
        row = c.execute("SELECT status FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise TransitionError(f"no run {run_id}")
        current = Status(row[0])
        if to not in ALLOWED[current]:
            raise TransitionError(f"run {run_id} cannot go from {current} to {to}")
        if to is Status.RUNNING:
            fields.setdefault("started_at", now)
        if to.terminal:
            fields.setdefault("ended_at", now)
        if message and to.terminal and "reason" not in fields:
            fields["reason"] = message
        c.execute("UPDATE runs SET status = ? WHERE id = ?", (to.value, run_id))
        store.update_run(run_id, **fields)
        store.add_event(run_id, "status", f"{to.value}: {message}" if message else to.value, ts=now)
