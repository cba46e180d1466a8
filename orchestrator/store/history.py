"""What earlier runs say: how long the same model took to load on the same host."""

from __future__ import annotations

import statistics
from typing import Any

from .db import Store
from .record import RunRecord

LOADING = ("starting", "loading")


def model_key(spec: dict[str, Any]) -> str | None:
    """What identifies 'the same model': the model path, or the command line for plain commands."""
    return spec.get("model") or spec.get("cmd")


def predicted_load_s(store: Store, run: RunRecord, last: int = 5) -> float | None:
    """Median time from start to the end of loading over the last runs of the same model on the host."""
    key = model_key(run.spec)
    if key is None:
        return None
    rows = store.conn.execute(
        "SELECT r.started_at, (SELECT MIN(e.ts) FROM events e WHERE e.run_id = r.id AND e.kind = 'phase'"
        f"  AND e.message NOT IN ({','.join('?' * len(LOADING))}, 'failed')) AS loaded_at"
        " FROM runs r WHERE r.host = ? AND r.id != ? AND r.started_at IS NOT NULL"
        # CASE, not AND: SQLite may evaluate AND's terms in any order, and json_extract raises on a
        # row that is not JSON, which would fail every later run on the host
        " AND CASE WHEN json_valid(r.spec)"
        "  THEN COALESCE(json_extract(r.spec, '$.model'), json_extract(r.spec, '$.cmd')) END = ?"
        " ORDER BY r.id DESC LIMIT 50",
        (*LOADING, run.host, run.id, key),
    ).fetchall()
    durations = [loaded - started for started, loaded in rows if loaded is not None][:last]
    return statistics.median(durations) if durations else None
