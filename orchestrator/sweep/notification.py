"""What a sweep tells its `notify` URLs when it finishes: the payload, and its sending."""

from __future__ import annotations

from typing import Any

from ..runflow import notify
from ..store import Store
from ..store import sweeps as stored_sweeps
from .plan import label

POINT_FIELDS = ("index", "point", "host", "status", "run_id", "metrics")


def payload(sweep_id: int, doc: dict[str, Any]) -> dict[str, Any]:
    """The outcome, and each point's status and metrics, from the sweep's status document; also as one
    line of `text` (and `content`) for chat webhooks."""
    title = f"{doc['name']} {doc['instance']}" if doc.get("instance") else doc["name"]
    counts = ", ".join(f"{n} {s}" for s, n in sorted(doc["counts"].items()))
    best = doc.get("best")
    if best:
        pt = next(p for p in doc["points"] if p["index"] == best["index"])
        metrics = {best["metric"]: best["value"]}
        head = f"orch sweep {sweep_id} ({title}) {doc['status']}: {counts}; best {label(pt['point'])} (run {best['run_id']})"
    else:
        metrics, head = {}, f"orch sweep {sweep_id} ({title}) {doc['status']}: {counts}"
    moved = doc.get("regression_line")
    line = notify.summary(head + (f"; {moved}" if moved else ""), None, metrics)
    return {
        "event": "sweep.finished", "sweep_id": sweep_id,
        "name": doc["name"], "playbook": doc["playbook"], "status": doc["status"], "counts": doc["counts"],
        "points": [{k: p[k] for k in POINT_FIELDS} for p in doc["points"]], "best": best,
        "regressions": doc.get("regressions") or [],
        "text": line, "content": line,
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
            stored_sweeps.add_event(own, sweep_id, "warning", f"notify {url}: {message}")
        finally:
            own.close()

    notify.send(urls, payload(sweep_id, doc), record)
