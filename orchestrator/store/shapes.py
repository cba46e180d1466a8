"""The JSON shapes `--json` prints, one per noun (docs/runs.md, "Output for scripts"): integers for counts,
one progress object everywhere, ISO 8601 times beside epoch seconds."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .db import Store
from .encoding import real_out
from .record import STOPPED_REASONS, RunRecord, Status

if TYPE_CHECKING:
    from .runtables import RunTables

PROGRESS_KEYS = ("label", "done", "total", "percent", "rate_per_s", "eta_s", "elapsed_s")


def number(value: Any) -> Any:
    """A whole float as an int (12 shards, not 12.0); anything else as it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def times(**stamps: float | None) -> dict[str, Any]:
    """`created_at` (epoch seconds) and `created_at_iso` side by side, for each stamp given."""
    doc: dict[str, Any] = {}
    for name, ts in stamps.items():
        doc[name] = ts
        doc[f"{name}_iso"] = iso(ts)
    return doc


def progress(p: dict[str, Any] | None) -> dict[str, Any] | None:
    """The progress object of `orch status` and `orch inspect-log` alike."""
    if not p:
        return None
    doc = {k: number(p.get(k)) for k in PROGRESS_KEYS}
    if doc["percent"] is None and doc["total"]:
        doc["percent"] = round(100 * doc["done"] / doc["total"], 1)
    return doc


def metrics(values: dict[str, float]) -> dict[str, Any]:
    return {k: number(v) for k, v in values.items()}


def shown_metrics(store: Store, run: RunRecord, headlines: Sequence[str] = ()) -> dict[str, Any]:
    """A run's metrics as its headline shows them: the latest of each; while it serves, a serving rate's
    steady state at work instead of the idle zero an engine prints after every burst. Its playbook's
    `headlines` (config/metricinfo.py) come first, then the rest by name."""
    serving = run.status is Status.RUNNING and run.phase in ("ready", "running")
    return metrics(in_order(store.headline_metrics(run.id) if serving else store.latest_metrics(run.id), headlines))


def in_order(values: dict[str, Any], headlines: Sequence[str]) -> dict[str, Any]:
    """The metrics the headlines name first, in their order, then the rest by name (as metricinfo.order)."""
    first = [h for h in headlines if h in values]
    return {name: values[name] for name in [*first, *sorted(values.keys() - set(first))]}


def shown_status(run: RunRecord, unreachable_since: float | None) -> str:
    """The status word a person reads: the lifecycle's, but `stopped` for a run ended on purpose and
    `unreachable` for an active run whose host stopped answering."""
    if run.status is Status.CANCELLED and (run.reason or "").startswith(STOPPED_REASONS):
        return "stopped"
    if unreachable_since is not None and not run.status.terminal:
        return "unreachable"
    return run.status.value


def shown_phase(run: RunRecord) -> str | None:
    """The phase a person reads: a job no engine knows (no bar, no ready line) is `running` once it
    prints, rather than `starting` for its whole life."""
    state = run.parser_state or {}
    if (run.status is Status.RUNNING and run.phase == "starting" and state.get("engine") in (None, "generic")
            and state.get("lines")):
        return "running"
    return run.phase


def unreachable_since(store: Store, run: RunRecord) -> float | None:
    """When the host of an active run stopped answering, if it has not answered since."""
    if run.status.terminal:
        return None
    last = store.last_event(run.id, ("unreachable", "reconnected"))
    return last["ts"] if last is not None and last["kind"] == "unreachable" else None


def error_hint(error: dict[str, Any] | None, phase: str | None = None) -> str | None:
    """The remedy the log parser gave a run's error; for an error recorded without one (by an older
    orch), the same diagnosis made now from its kind, class, message, chain and context lines."""
    if not error or not error.get("kind"):
        return None
    if error.get("hint"):
        return str(error["hint"])
    from ..logparse.errors import LogError
    from ..logparse.hints import hint_of

    err = LogError(kind=str(error["kind"]), exception=error.get("exception"), message=str(error.get("message") or ""),
                   line=int(error.get("line") or 0), context=[str(c) for c in error.get("context") or []],
                   chain=[str(c) for c in error.get("chain") or []])
    return hint_of(err, phase)


def _reals(section: Any, columns: frozenset[str]) -> Any:
    """A plugin's section with the NaN its REAL columns hold as text (encoding.real_in) a NaN again."""
    if isinstance(section, list):
        return [_reals(item, columns) for item in section]
    if isinstance(section, dict):
        return {k: real_out(v) if k in columns else _reals(v, columns) for k, v in section.items()}
    return section


def sections(store: Store, run_id: int, tables: Iterable[RunTables]) -> dict[str, Any]:
    """Each plugin's section of a run, read from its own tables (made now if this database has not yet; a
    reader that may not write shows none of a plugin whose tables are not made)."""
    found = {}
    for t in tables:
        if not store.has_tables_of(t):
            if not store.writable:
                continue
            store.use(t)
        section = t.section(store.db, run_id)
        if section is not None:
            found[t.name] = _reals(section, store.real_columns(t))
    return found


def fraction_done(p: dict[str, Any] | None) -> float | None:
    """How much of its work a progress object says is done (0 to 1); None without a total."""
    if not p or not p.get("total"):
        return None
    return float(p.get("done") or 0) / float(p["total"])


def slowest_progress(nodes: list[RunRecord]) -> dict[str, Any] | None:
    """The progress of the node least far along, among those that report one: a multi-node run is done
    only when its slowest rank is, so the run's progress is that rank's (nodes that print no bar, often
    every rank but the first, are left out)."""
    reported = [(f, n.progress) for n in nodes if (f := fraction_done(n.progress)) is not None]
    return min(reported, key=lambda found: found[0])[1] if reported else None


def node_document(node: RunRecord) -> dict[str, Any]:
    """One node of a multi-node run, as the `nodes` list of `orch status --json` holds it."""
    return {"rank": node.node_rank or 0, "id": node.id, "host": node.host, "status": node.status.value,
            "phase": node.phase, "job": node.job_id if node.job_id is not None else node.pid,
            "log_offset": node.log_offset, "progress": progress(node.progress), "reason": node.reason,
            "remote_dir": node.remote_dir}


def nodes_of(store: Store, run: RunRecord) -> list[RunRecord]:
    """A multi-node run's node records in rank order, [] for a one-host run (asked of the store only for a
    record with a rank: one-host runs have none, and a table of them costs no query more)."""
    return store.nodes_of(run.id) if run.node_rank is not None else []


def run_document(store: Store, run: RunRecord, with_events: bool = True, tables: Iterable[RunTables] = (),
                 headlines: Sequence[str] = ()) -> dict[str, Any]:
    """A run as `orch status --json` prints it, its playbook's `headlines` leading its metrics (the caller
    has them from config/metricinfo.py); with events, each plugin's section too (`tables`). A
    multi-node run's document is its head's, with `nodes` (one entry each, rank order) and the slowest
    node's progress; a node's own record (not the head) names its run in `parent_id`."""
    error = run.error
    silent_since = unreachable_since(store, run)
    nodes = nodes_of(store, run) if run.parent_id is None else []
    shown_progress = (slowest_progress(nodes) or run.progress) if nodes else run.progress
    doc = {
        "id": run.id,
        "name": run.name,
        "tags": run.tags,
        "note": run.note,
        "playbook": run.playbook,
        "host": run.host,
        "status": run.status.value,
        "phase": run.phase,
        "shown_status": shown_status(run, silent_since),  # the words `orch status` shows
        "shown_phase": shown_phase(run),
        "stalled": run.stalled,
        "progress": progress(shown_progress),
        "error": ({**{k: error.get(k) for k in ("kind", "exception", "message")}, "hint": error_hint(error)}
                  if error else None),
        "reason": run.reason,
        "invalid": run.invalid,  # why its numbers do not count (None: valid); the status stays what happened
        "receipt": run.receipt,  # what produced its numbers (store/receipts.py)
        "last_line": run.last_line,  # the log's last line as of the last poll
        "metrics": shown_metrics(store, run, headlines),
        # per metric: last, and mean and p50 over the steady state (the first 10 % of samples left out)
        "metric_summaries": {k: {f: number(v) for f, v in s.items()}
                             for k, s in in_order(store.metric_summaries(run.id), headlines).items()},
        "headlines": list(headlines),  # the metrics a person reads first
        "exit_code": run.exit_code,
        "pid": run.pid,
        "job_id": run.job_id,
        "node": run.node,
        "queue_reason": run.queue_reason,
        "remote_dir": run.remote_dir,
        "sweep_id": run.sweep_id,
        "parent_id": run.parent_id,  # a node's record (rank > 0): the run it is a node of
        "node_rank": run.node_rank,
        "hosts": [n.host for n in nodes] if nodes else [run.host],  # each node's host, rank order
        "nodes": [node_document(n) for n in nodes],  # [] for a one-host run
        "point": run.point_diff,  # a sweep's run: its point's spec differences from the sweep's base spec
        **times(created_at=run.created_at, started_at=run.started_at, ended_at=run.ended_at,
                predicted_ready_at=run.predicted_at, unreachable_since=silent_since),
        "duration_s": round(run.ended_at - run.started_at, 3) if run.ended_at and run.started_at else None,
        "spec": None if "spec" in run.unreadable else run.spec,
        "end_steps": run.end_steps,  # the end steps that ran (log to end, patch revert, outputs, log tail, notify)
    }
    if with_events:
        doc.update(sections(store, run.id, tables))
        # data: what the event carries beyond its line (a stall's stacks, an error's context lines), or null
        doc["events"] = [{"ts": e["ts"], "ts_iso": iso(e["ts"]), "kind": e["kind"], "message": e["message"],
                          "data": e["data"]} for e in store.events(run.id)]
    return doc
