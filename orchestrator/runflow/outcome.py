"""What a person needs when a run ends: on success how long it took, its key metrics, where its outputs
are and what to run next; on failure the cause, what to try (the log parser's diagnosis), the log lines that explain it, and
`orch logs N`."""

from __future__ import annotations

import re
from typing import Any

from ..config import metricinfo
from ..config.hosts import Host
from ..config.workspace import Workspace
from ..errors import OrchError
from ..host.health import SERVING_PHASES
from ..store import Store
from ..store.record import RunRecord, Status
from ..store.shapes import error_hint, shown_metrics, times

EXPLAIN_LINES = 8


def _explaining_lines(ws: Workspace, run: RunRecord) -> list[str]:
    """The lines around the error the log parser found, else the last lines of the fetched log tail."""
    context = (run.error or {}).get("context") or []
    if context:
        return [str(line) for line in context][-EXPLAIN_LINES:]
    tail = ws.runs_dir / str(run.id) / "log.tail"
    if tail.is_file():
        lines = [line for line in tail.read_text(errors="replace").splitlines() if line.strip()]
        return lines[-EXPLAIN_LINES:]
    return []


def server_url(run: RunRecord, host: Host | None) -> str | None:
    """Where a running, ready server answers: its playbook's address, else the one its log says it serves on
    (vLLM's 'Starting vLLM server on http://...', whatever ran it); None for anything else."""
    if host is None or run.status is not Status.RUNNING or run.phase not in SERVING_PHASES:
        return None
    from pydantic import ValidationError

    from . import registry

    try:
        pb = registry.playbook(run.playbook)
        url = pb.url(pb.Spec.model_validate(run.spec), host)
    except (OrchError, ValidationError):  # a playbook gone from this install, a spec it no longer takes
        url = None
    return url or logged_url(run, host)


_ANY_ADDRESS = re.compile(r"^(https?://)(0\.0\.0\.0|\[::\]|::)(?=[:/]|$)")


def logged_url(run: RunRecord, host: Host) -> str | None:
    """The address the server's log says it serves on, as the host's address when it listens on all of them."""
    said = (run.parser_state or {}).get("url")
    if not isinstance(said, str) or not said:
        return None
    address = host.address or ("127.0.0.1" if host.is_local else host.name)
    return _ANY_ADDRESS.sub(lambda m: m.group(1) + (f"[{address}]" if ":" in address else address), said)


def summary(ws: Workspace, store: Store, run: RunRecord, host: Host | None = None) -> dict[str, Any]:
    """The end-of-run summary `orch run` and `orch watch` print (and give as JSON)."""
    outputs = ws.runs_dir / str(run.id) / "outputs.json"
    doc: dict[str, Any] = {
        "id": run.id, "playbook": run.playbook, "host": run.host, "status": run.status.value,
        "phase": run.phase,
        "duration_s": round(run.ended_at - run.started_at, 1) if run.ended_at and run.started_at else None,
        **times(started_at=run.started_at, ended_at=run.ended_at),
        "metrics": shown_metrics(store, run, headlines := metricinfo.headlines(run.playbook)),
        "headlines": list(headlines),
        "outputs": {"remote_dir": run.remote_dir, "manifest": str(outputs) if outputs.is_file() else None},
        "cause": None, "hint": None, "log_lines": [], "next": [], "url": server_url(run, host),
    }
    if run.status is Status.SUCCEEDED:
        doc["next"] = [f"orch status {run.id}"]
    elif run.status.live:  # ready (--until-ready) or detached
        doc["next"] = [f"orch logs {run.id} -f", f"orch stop {run.id}"]
    else:
        error = run.error or {}
        detail = " ".join(str(error[k]) for k in ("exception", "message") if error.get(k))
        cause = run.reason or detail or None
        if cause and detail and detail not in cause:
            cause += f" ({detail})"
        doc["cause"] = cause
        doc["hint"] = error_hint(run.error)
        doc["log_lines"] = _explaining_lines(ws, run)
        doc["next"] = [f"orch logs {run.id}"] if run.remote_dir else [f"orch status {run.id}"]
    return doc
