"""orch status: the runs table a person reads (or scripts parse, piped), and one run in full."""

from __future__ import annotations

import json
import time
from typing import Any

import typer

from ..config import metricinfo
from ..config.workspace import Workspace
from ..errors import OrchError, UsageError
from ..store import runtables, summaries
from ..store.record import ACTIVE, STATUS_WORDS, RunRecord, Status
from ..store.shapes import run_document
from .app import age_seconds, app, inventory, no_runs_note, open_store, parse_run_id, read_store, workspace
from .render import Fit, Styled, age, duration, emit_json, err, out, progress_line, shown_of, table

STATUS_EXAMPLES = """Examples:

  orch status --active

  orch status --status stopped --columns id,playbook,status,metrics

  orch status --status running --host gpu01

  orch status --tag baseline --since 3d

  orch status --sweep 4

  orch status 7 --json
"""

# On a terminal: what needs a look in red, what is under way in cyan, what went well in green.
STATUS_STYLES = {"succeeded": "green", "failed": "red", "lost": "red", "unreachable": "bold red",
                 "cancelled": "yellow", "stopped": "blue", "running": "cyan"}
PHASE_STYLES = {"ready": "green", "finished": "green", "failed": "red", "queued": "yellow"}
COLUMNS = ["id", "name", "playbook", "host", "status", "phase", "progress", "metrics", "duration", "age", "seen",
           "reason", "url"]
STATUS_HELP = "only runs in this status (repeatable): " + ", ".join(STATUS_WORDS)
COLUMNS_HELP = "only these columns, in this order: " + ",".join(COLUMNS)


@app.command(epilog=STATUS_EXAMPLES)
def status(
    run_id: str | None = typer.Argument(None, metavar="ID"),
    as_json: bool = typer.Option(False, "--json"),
    refresh: bool = typer.Option(False, "--refresh", help="poll the host of every active run once"),
    limit: int = typer.Option(50, "--limit", "-n", metavar="N"),
    statuses: list[str] = typer.Option([], "--status", metavar="WORD", help=STATUS_HELP),
    active: bool = typer.Option(False, "--active", help="only runs not ended yet"),
    host: str | None = typer.Option(None, "--host", "-H", metavar="HOST", help="only runs on this host"),
    playbook: str | None = typer.Option(None, "--playbook", metavar="PLAYBOOK", help="only runs of this playbook"),
    tag: str | None = typer.Option(None, "--tag", metavar="TAG", help="only runs with this tag"),
    sweep: int | None = typer.Option(None, "--sweep", metavar="ID", help="only runs of this sweep"),
    since: str | None = typer.Option(None, "--since", metavar="AGE", help="only runs created within AGE (2h, 3d)"),
    timeout: float = typer.Option(30.0, metavar="SECONDS", help="seconds per host for --refresh"),
    columns: str | None = typer.Option(None, "--columns", metavar="A,B,C", help=COLUMNS_HELP),
) -> None:
    """Show runs, newest first, or one run in full."""
    shown_columns = chosen_columns(columns)
    unknown = [w for w in statuses if w not in STATUS_WORDS]
    if unknown:
        raise UsageError(f"--status: {unknown[0]!r} is not one of {', '.join(STATUS_WORDS)}")
    ws = workspace()
    store = open_store(ws) if refresh else read_store(ws)
    if refresh:
        from .. import runflow

        runflow.refresh(ws, store, [parse_run_id(run_id)] if run_id else None, timeout, err.print)
    active_runs = store.list_runs(limit=100_000, statuses=[s.value for s in ACTIVE])
    if active_runs:  # a run whose watcher died gets a new one (the watchers' module: only for active runs)
        from ..runflow import watching

        watching.ensure_watched(ws, store, active_runs)
    urls = ServerUrls(ws)
    if run_id is not None:
        run = store.get_run(parse_run_id(run_id))
        tables = runtables.installed(on_broken=lambda line: err.print(f"orch: {line}", markup=False))
        doc = {**run_document(store, run, tables=tables, headlines=metricinfo.headlines(run.playbook)),
               "url": urls.of(run)}
        emit_json(doc) if as_json else _print_run(doc, tables)
        return
    wanted = [s for s in (statuses or list(STATUS_WORDS)) if s in {a.value for a in ACTIVE}] if active else statuses
    filters: dict[str, Any] = {"words": wanted if active or wanted else None, "host": host,
                               "playbook": playbook, "tag": tag, "sweep_id": sweep,
                               "since": time.time() - age_seconds(since) if since is not None else None}
    runs = store.list_runs(limit=limit, **filters)
    if not runs:
        no_runs_note(ws)
    shown_of(len(runs), store.count_runs(**filters) if len(runs) == limit else len(runs), "runs")
    docs = [{**run_document(store, r, with_events=False, headlines=metricinfo.headlines(r.playbook)), "url": urls.of(r)}
            for r in runs]
    if as_json:
        emit_json(docs)
        return
    now = time.time()
    rows = [_row(doc, run, now) for doc, run in zip(docs, runs)]
    index = [COLUMNS.index(c) for c in shown_columns]
    # on a terminal the table fits its width; columns chosen are shortened but kept, even empty
    table(shown_columns, [[row[i] for i in index] for row in rows], drop_empty=out.is_terminal and columns is None,
          fit=FIT if columns is None else Fit(FIT.shrink, ()))


# How the table fits a terminal (80 columns and up): the free text gives way first, shortened after a
# word, then the columns a person can do without leave; id, status and phase always stay whole.
FIT = Fit(shrink={"reason": 12, "progress": 14, "url": 16, "name": 8, "playbook": 13, "metrics": 24, "host": 8},
          drop=("url", "seen", "age", "name", "reason", "duration", "host", "progress", "metrics"),
          keep_last_word=frozenset({"progress"}))  # a bar's label gives way to its counts


def chosen_columns(columns: str | None) -> list[str]:
    """The columns `--columns` names (all of them when not given); an unknown one is bad input."""
    if columns is None:
        return list(COLUMNS)
    chosen = [c.strip() for c in columns.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in COLUMNS]
    if unknown or not chosen:
        raise UsageError(f"--columns {columns!r}: {'unknown column ' + repr(unknown[0]) if unknown else 'none named'};"
                         f" choose from {','.join(COLUMNS)}")
    return list(dict.fromkeys(chosen))


class ServerUrls:
    """The URL of each ready server; the inventory is read only when a row needs it."""

    def __init__(self, ws: Workspace):
        self.ws = ws
        self.hosts: Any = None

    def of(self, run: RunRecord) -> str | None:
        if run.status is not Status.RUNNING:  # asked first: importing health imports the hosts and pydantic
            return None
        from ..host.health import SERVING_PHASES

        if run.phase not in SERVING_PHASES:
            return None
        from ..runflow import outcome

        try:
            self.hosts = self.hosts or inventory(self.ws)
            return outcome.server_url(run, self.hosts.get(run.host))
        except OrchError:  # an inventory that no longer reads, or no longer names the host: no URL
            return None


NODE_COLUMNS = ["rank", "id", "host", "status", "phase", "job", "progress", "reason", "remote dir"]


def _node_row(node: dict[str, Any]) -> list[Any]:
    p = node["progress"]
    prog = f"{p['label'] or ''} {p['done']:g}/{p['total']:g}".strip() if p and p.get("total") else ""
    return [node["rank"], node["id"], node["host"], Styled(node["status"], STATUS_STYLES.get(node["status"])),
            node["phase"] or "", node["job"], prog, node["reason"] or "", node["remote_dir"] or ""]


def _row(doc: dict[str, Any], run: RunRecord, now: float) -> list[Any]:
    p = doc["progress"]
    prog = f"{p['label'] or ''} {p['done']:g}/{p['total']:g}".strip() if p and p.get("total") else ""
    if not p and doc["predicted_ready_at"] and doc["status"] == "running":
        prog = f"loaded in ~{max(0, doc['predicted_ready_at'] - now):.0f}s (history)"
    metrics = " ".join(f"{k}={v:g}" for k, v in list(doc["metrics"].items())[:3])
    phase = doc["shown_phase"] or ""
    if phase == "queued" and doc["queue_reason"]:
        phase = f"queued ({doc['queue_reason']})"
    word = doc["shown_status"]
    shown = word + (" (stalled)" if doc["stalled"] else "")
    # how fresh an active row is: when its watcher last heard from the host
    seen = age(now - run.heartbeat) + " ago" if run.heartbeat and not run.status.terminal else ""
    took = duration((run.ended_at or now) - run.started_at) if run.started_at else ""
    return [doc["id"], doc["name"], doc["playbook"], hosts_cell(doc["hosts"]),
            Styled(shown, "yellow" if doc["stalled"] else STATUS_STYLES.get(word)),
            Styled(phase, PHASE_STYLES.get(doc["shown_phase"] or "")), prog, metrics, took,
            age(now - doc["created_at"]), seen, _reason_cell(run.status, doc), doc["url"]]


def _reason_cell(status: Status, doc: dict[str, Any]) -> str:
    """Why a run ended as it did; for one whose numbers do not count, that first (`invalid: ...`)."""
    if doc["invalid"]:
        return f"invalid: {doc['invalid']}"
    return "" if status is Status.SUCCEEDED else doc["reason"] or ""


HOSTS_CELL_MAX = 20  # past this a multi-node run's hosts show as `gpu01+3`, as wide as a host name


def hosts_cell(hosts: list[str]) -> str:
    """A run's hosts in the table's host column: each distinct host in rank order when they fit, else the
    head's and how many others (`gpu01+3`)."""
    distinct = list(dict.fromkeys(hosts))
    joined = ",".join(distinct)
    return joined if len(distinct) == 1 or len(joined) <= HOSTS_CELL_MAX else f"{distinct[0]}+{len(distinct) - 1}"


def _print_run(doc: dict[str, Any], tables: list[runtables.RunTables]) -> None:
    phase = f" ({doc['shown_phase']})" if doc["shown_phase"] else ""
    name = f" ({doc['name']})" if doc["name"] else ""
    on = hosts_cell(doc["hosts"]) if doc["nodes"] else doc["host"]
    out.print(f"run {doc['id']}{name} {doc['playbook']} on {on}: {doc['shown_status']}{phase}")
    if doc["parent_id"] is not None:  # a node's own record: the run (its head) is what a person acts on
        out.print(f"  node {doc['node_rank']} of run {doc['parent_id']} (`orch status {doc['parent_id']}`)",
                  markup=False)
    if doc["tags"]:
        out.print("  tags: " + ", ".join(doc["tags"]))
    for line in (doc["note"] or "").splitlines():
        out.print(f"  note: {line}")
    if doc["invalid"]:
        out.print(f"  invalid: {doc['invalid']} (its numbers count nowhere: no sweep's best, no objective)",
                  markup=False)
    for line in receipt_lines(doc["receipt"]):
        out.print(f"  {line}", markup=False)
    for key in ("url", "reason", "exit_code", "job_id" if doc.get("job_id") else "pid", "node", "queue_reason",
                "remote_dir", "duration_s"):
        if doc.get(key) is not None:
            out.print(f"  {key}: {doc[key]}")
    if doc["unreachable_since"] is not None:
        out.print(f"  unreachable: the host has not answered for {age(time.time() - doc['unreachable_since'])}")
    if doc["progress"]:
        slowest = " (the slowest node's)" if doc["nodes"] else ""
        out.print("  progress: " + progress_line(doc["progress"], doc["phase"]) + slowest)
    if doc["predicted_ready_at"] and doc["phase"] in ("starting", "loading"):
        left = doc["predicted_ready_at"] - time.time()
        out.print(f"  loading should end in ~{max(left, 0):.0f} s (earlier runs of this model here)")
    if doc["stalled"]:
        out.print("  stalled: no progress for longer than usual")
    if doc["error"]:
        e = doc["error"]
        out.print(f"  error: {e['kind']}: {e['exception'] or ''} {e['message']}")
        if e.get("hint"):
            out.print(f"  try: {e['hint']}", markup=False)
    for k, s in doc["metric_summaries"].items():  # mean and p50: the first 10 % of samples left out
        out.print(f"  {summaries.line(k, s)}", markup=False)
    if doc["nodes"]:
        out.print(f"  nodes ({len(doc['nodes'])}):")
        table(NODE_COLUMNS, [_node_row(n) for n in doc["nodes"]])
    for t in tables:  # each plugin's section, as the plugin shows it
        shown = t.show(doc[t.name]) if t.name in doc else None
        if shown is not None:
            out.print(f"  {shown.title}:", markup=False)
            table(shown.columns, shown.rows)
    out.print("  spec: " + json.dumps(doc["spec"]))
    for e in doc["events"]:
        out.print(f"  {time.strftime('%m-%d %H:%M:%S', time.localtime(e['ts']))} {e['kind']}: {e['message']}")


def receipt_lines(receipt: dict[str, Any] | None) -> list[str]:
    """The receipt in a few lines: engine, patches, model, data set, repeats, hardware (all of it: --json)."""
    if not receipt:
        return []
    engine = receipt.get("engine") or {}
    lines = [(f"receipt: {engine.get('name')} {engine.get('version') or '?'} ({engine.get('python')}), "
              f"orch {receipt.get('orch')}, host {receipt.get('host')} ({receipt.get('hostname') or '?'})")]
    for p in receipt.get("patches") or []:
        lines.append(f"  patch {p.get('name')} {str(p.get('set_hash') or '')[:12]} on {p.get('package')} "
                     f"{p.get('version')}" + (", reverted" if p.get("reverted") else ""))
    model = receipt.get("model") or {}
    if model:
        lines.append(f"  model {model.get('path')}: " + " ".join(f"{k} {str(v)[:12]}" for k, v in
                                                                 (model.get("files") or {}).items()))
    if receipt.get("dataset"):
        d = receipt["dataset"]
        lines.append(f"  data set {d.get('name')}, {d.get('num_prompts')} prompts, seed {d.get('seed')}, "
                     f"warm-up {receipt.get('warmup')}, repeats {receipt.get('repeats')}")
    hw = receipt.get("hardware") or {}
    gpus = hw.get("gpus") or []
    if gpus:
        lines.append(f"  {len(gpus)} GPU(s): {gpus[0].get('name')}, driver {gpus[0].get('driver_version')}")
    elif hw.get("cpu"):
        lines.append(f"  CPU: {hw['cpu'].get('model')} x{hw['cpu'].get('count')}")
    server = receipt.get("server")
    if server:
        lines.append(f"  server: run {server.get('run')}" + ("" if server.get("ready_at_launch") else " (not ready)"))
    return lines
