"""What a sweep tells its `notify` URLs when it finishes: the payload, and its sending."""

from __future__ import annotations

from typing import Any

from .. import notify
from ..store import Store
from . import db

POINT_FIELDS = ("index", "point", "host", "status", "run_id", "metrics")


def payload(sweep_id: int, doc: dict[str, Any]) -> dict[str, Any]:
    """The outcome, and each point's status and metrics, from the sweep's status document."""
    return {
        "event": "sweep.finished", "sweep_id": sweep_id,
        "name": doc["name"], "playbook": doc["playbook"], "status": doc["status"], "counts": doc["counts"],
        "points": [{k: p[k] for k in POINT_FIELDS} for p in doc["points"]],
    }


def announce(store: Store, sweep_id: int, doc: dict[str, Any]) -> None:
    """Send the payload to the sweep's URLs in a daemon thread: it never holds up or fails the sweep;
    a URL that finally fails is a `warning` event."""
    urls = list(doc.get("notify") or [])
    if not urls:
        return
    db_path = store.path

    def record(url: str, message: str) -> None:
        own = Store(db_path)  # the sending thread's own connection
        try:
            db.add_event(own, sweep_id, "warning", f"notify {url}: {message}")
        finally:
            own.close()

    notify.send(urls, payload(sweep_id, doc), record)
