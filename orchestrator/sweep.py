"""Sweeps: one playbook over a grid of spec values, spread over hosts, resumable, with a failure policy.

The sweep file (TOML) names the playbook, the hosts (or tags), a base `[spec]`, a `[matrix]` whose every
combination of values is a point (dotted keys such as `"env.X"` reach into tables) and `[[include]]`
extra points. Every point is validated before anything starts. Points go round-robin over the hosts;
a host runs one point at a time, or one per GPU set when points ask for `gpus` (the leases keep
overlapping sets apart whatever the file says).

A sweep is its name, the sha256 of its file and an instance (free text, '' by default; a nightly cron
entry uses the date): running the same file with the same instance again resumes it. Points that
succeeded, or failed by a crash inside the job, are not run again; a run whose controller died is
watched again (or settled, when it never launched); every other point runs. A changed file is a new
sweep (the old one stays in the history under the same name).

Failures that are the fleet's fault (host unreachable at start, a job `lost`) are retried `retries`
times, `retry_backoff_s` apart; a crash inside the job never is. With `fail_fast`, the first job
failure cancels the points still queued.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from . import lease, notify, registry, runflow
from .controller import Controller
from .errors import HostKeyError, NotFound, OrchError, Unreachable, UsageError
from .hosts import NAME_PATTERN, Host, Inventory
from .record import ACTIVE, Run, Status
from .store import Store
from .workspace import Workspace

HEARTBEAT_S = 5.0  # at most this often, a running sweep stamps its row on its watchers' polls
# A controller on another machine is taken for dead after this long without a stamp: its watchers may
# poll as rarely as the longest default poll interval (600 s).
CONTROLLER_STALE_S = 3 * 600.0


class SweepFile(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # `retry_backoff_s = inf` waits forever

    name: str = Field(pattern=NAME_PATTERN)
    playbook: str
    hosts: list[str] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list)
    spec: dict[str, Any] = Field(default_factory=dict)
    matrix: dict[str, Any] = Field(default_factory=dict)
    include: list[dict[str, Any]] = Field(default_factory=list)
    retries: int = Field(default=1, ge=0, description="extra attempts for failures that are the fleet's fault")
    retry_backoff_s: float = Field(default=30.0, ge=0)
    fail_fast: bool = False
    notify: list[str] = Field(default_factory=list, description="URLs told when the sweep finishes")

    @model_validator(mode="after")
    def _where(self) -> SweepFile:
        if bool(self.hosts) == bool(self.tags):
            raise ValueError("give either hosts = [...] or tags = [...]")
        return self


@dataclass(frozen=True)
class Point:
    index: int
    diff: dict[str, Any]  # dotted key -> value: what this point changes in the base spec
    spec: Any  # the playbook's Spec, validated
    host: str

    @property
    def key(self) -> str:
        return point_key(self.diff)

    @property
    def label(self) -> str:
        return label(self.diff)

    @property
    def lane(self) -> str:
        gpus = self.spec.gpus
        return self.host if gpus is None else f"{self.host}:{','.join(map(str, sorted(gpus)))}"


@dataclass
class Plan:
    path: Path
    file_hash: str
    file: SweepFile
    playbook: Any
    hosts: list[Host]
    points: list[Point]
    instance: str = ""  # with name and file_hash, which sweep this is: '' unless the caller names one


def point_key(diff: dict[str, Any]) -> str:
    return json.dumps(diff, sort_keys=True)


def label(diff: dict[str, Any]) -> str:
    return " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in diff.items()) or "base spec"


# the file -------------------------------------------------------------------------------------------
def _read(path: Path) -> tuple[str, dict[str, Any]]:
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, IsADirectoryError):
        raise UsageError(f"sweep file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not text: {exc}") from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: invalid TOML: {exc}") from None


def load(path: Path) -> SweepFile:
    """Parse and check a sweep file on its own (no inventory, no playbook spec)."""
    _, raw = _read(path)
    try:
        file = SweepFile.model_validate(raw)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc'])) or 'sweep'}: {e['msg'].removeprefix('Value error, ')}"
                    for e in exc.errors()]
        raise UsageError(f"{path}: invalid sweep: " + "; ".join(problems)) from None
    expand(file)
    return file


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def expand(file: SweepFile) -> list[dict[str, Any]]:
    """Every point's differences: the matrix's combinations in order, then the includes not already there."""
    axes = _flatten(file.matrix)
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise UsageError(f"matrix.{key}: expected a non-empty list of values")
    diffs = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] if axes else []
    for n, extra in enumerate(file.include):
        diff = _flatten(extra)
        if not diff:
            raise UsageError(f"include[{n}]: an empty point")
        diffs.append(diff)
    unique: list[dict[str, Any]] = []  # a repeated value or an include already in the grid: one point
    for diff in diffs:
        if diff not in unique:
            unique.append(diff)
    return unique or [{}]


def _apply(base: dict[str, Any], diff: dict[str, Any]) -> dict[str, Any]:
    values = copy.deepcopy(base)
    for dotted, value in diff.items():
        *parents, leaf = dotted.split(".")
        table = values
        for part in parents:
            if not isinstance(table.get(part), dict):
                table[part] = {}
            table = table[part]
        table[leaf] = copy.deepcopy(value)
    return values


def plan(ws: Workspace, store: Store, path: Path, instance: str = "") -> Plan:
    """Validate everything — the file, the hosts, every point's spec — before anything starts."""
    from . import spec as specmod

    path = Path(path).expanduser().resolve()
    text, _ = _read(path)
    file = load(path)
    pb = registry.playbook(file.playbook)
    inv = Inventory.load(ws.hosts_file, ws.root)
    hosts = inv.select(file.hosts or None, file.tags or None)
    if not hosts:
        raise UsageError(f"{path}: no host of the inventory has the tags {', '.join(file.tags)}")
    points = []
    for i, diff in enumerate(expand(file)):
        host = hosts[i % len(hosts)]
        spec = specmod.build(pb.Spec, _apply(file.spec, diff), source=f"point {i} ({label(diff)})")
        try:
            runflow.check(store, pb, spec, host)
        except UsageError as exc:
            raise UsageError(f"invalid point {i} ({label(diff)}): {exc}") from None
        points.append(Point(i, diff, spec, host.name))
    return Plan(path, hashlib.sha256(text.encode()).hexdigest(), file, pb, hosts, points, instance)


# the database ---------------------------------------------------------------------------------------
def register(store: Store, p: Plan) -> int:
    """The sweep's id: the existing one for this name, file content and instance, or a new one with its points."""
    with store.tx() as c:
        row = c.execute("SELECT id FROM sweeps WHERE name = ? AND file_hash = ? AND instance = ?",
                        (p.file.name, p.file_hash, p.instance)).fetchone()
        if row:
            return int(row[0])
        cur = c.execute(
            "INSERT INTO sweeps (name, file_hash, instance, path, playbook, doc, notify, status, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', ?)",
            (p.file.name, p.file_hash, p.instance, str(p.path), p.file.playbook, p.file.model_dump_json(),
             json.dumps(p.file.notify), time.time()),
        )
        sweep_id = int(cur.lastrowid or 0)
        c.executemany(
            "INSERT INTO sweep_points (sweep_id, idx, point, host, gpus, status, attempts) VALUES (?, ?, ?, ?, ?, 'queued', 0)",
            [(sweep_id, pt.index, pt.key, pt.host, json.dumps(pt.spec.gpus) if pt.spec.gpus is not None else None)
             for pt in p.points],
        )
        add_event(store, sweep_id, "created", f"{len(p.points)} points on {', '.join(h.name for h in p.hosts)}")
    return sweep_id


def add_event(store: Store, sweep_id: int | None, kind: str, message: str = "", data: Any = None) -> None:
    with store.tx() as c:
        c.execute("INSERT INTO sweep_events (sweep_id, ts, kind, message, data) VALUES (?, ?, ?, ?, ?)",
                  (sweep_id, time.time(), kind, message, json.dumps(data) if data is not None else None))


def events(store: Store, sweep_id: int) -> list[dict[str, Any]]:
    rows = store.conn.execute("SELECT ts, kind, message, data FROM sweep_events WHERE sweep_id = ? ORDER BY id",
                              (sweep_id,))
    return [{"ts": ts, "kind": k, "message": m, "data": json.loads(d) if d else None} for ts, k, m, d in rows]


def _me() -> str:
    return str(Controller.me())


def _controller_alive(controller: str | None, heartbeat: float | None) -> bool:
    found = Controller.parse(controller)
    return found is not None and found.alive(heartbeat, CONTROLLER_STALE_S)


def _sweep_row(store: Store, sweep_id: int) -> dict[str, Any]:
    cur = store.conn.execute("SELECT * FROM sweeps WHERE id = ?", (sweep_id,))
    row = cur.fetchone()
    if row is None:
        raise NotFound(f"no sweep {sweep_id}")
    return dict(zip([d[0] for d in cur.description], row))


def _check_not_running(row: dict[str, Any]) -> None:
    if row["controller"] and row["controller"] != _me() and _controller_alive(row["controller"], row["heartbeat"]):
        who = Controller.parse(row["controller"])
        where = f"controller pid {who.pid} on {who.hostname}" if who else "another controller"
        raise OrchError(f"sweep {row['id']} ({row['name']}) is already running ({where}); "
                        f"`orch sweep status {row['id']}` shows it")


def claim(store: Store, sweep_id: int) -> None:
    """Make this process the sweep's controller, unless a live one already is."""
    with store.tx() as c:
        _check_not_running(_sweep_row(store, sweep_id))
        c.execute("UPDATE sweeps SET status = 'running', controller = ?, heartbeat = ?, ended_at = NULL WHERE id = ?",
                  (_me(), time.time(), sweep_id))
        # what did not finish last time runs again
        c.execute("UPDATE sweep_points SET status = 'queued', fault = NULL, reason = NULL WHERE sweep_id = ?"
                  " AND (status = 'cancelled' OR (status = 'failed' AND COALESCE(fault, '') != 'job'))",
                  (sweep_id,))


def resolve(store: Store, ref: str | None) -> int:
    """A sweep by id or by name (the newest of that name); None: the newest sweep."""
    if ref is None:
        row = store.conn.execute("SELECT MAX(id) FROM sweeps").fetchone()
        if row[0] is None:
            raise NotFound("no sweeps yet")
        return int(row[0])
    if ref.isascii() and ref.isdigit() and len(ref) <= 18:  # not '²', nor past SQLite's integers
        _sweep_row(store, int(ref))
        return int(ref)
    row = store.conn.execute("SELECT MAX(id) FROM sweeps WHERE name = ?", (ref,)).fetchone()
    if row[0] is None:
        raise NotFound(f"no sweep {ref!r}")
    return int(row[0])


def _latest_run(store: Store, sweep_id: int, key: str) -> Run | None:
    row = store.conn.execute("SELECT MAX(id) FROM runs WHERE sweep_id = ? AND point = ?", (sweep_id, key)).fetchone()
    return store.get_run(row[0]) if row[0] is not None else None


def verdict(run: Run) -> str:
    """What a point's run says about the point: active | succeeded | job | fleet | cancelled | setup."""
    status = run.status
    if not status.terminal:
        return "active"
    if status is Status.SUCCEEDED:
        return "succeeded"
    if status is Status.FAILED and run.launched:
        return "job"  # the job ran and failed: its own fault, never retried
    if status is Status.LOST:
        return "fleet"
    return "cancelled" if status is Status.CANCELLED else "setup"


# hooks -----------------------------------------------------------------------------------------------
def on_run_ended(store: Store, sweep_id: int, point: int, run_id: int) -> None:
    """Called when a point's run ends. Records an event; notification hooks in here."""
    run = store.get_run(run_id)
    add_event(store, sweep_id, "run_ended", f"point {point}: run {run_id} {run.status}",
              {"point": point, "run_id": run_id, "status": run.status.value})


def on_sweep_finished(store: Store, sweep_id: int) -> None:
    """Called when a sweep finishes (whatever its outcome). Records an event; notification hooks in here."""
    row = _sweep_row(store, sweep_id)
    add_event(store, sweep_id, "finished", row["status"], {"notify": json.loads(row["notify"] or "[]")})
    _notify(store, sweep_id)  # a daemon thread: never holds up or fails the sweep


def _notify(store: Store, sweep_id: int) -> None:
    """Announce the outcome and each point's status and metrics to the sweep's URLs."""
    doc = document(store, sweep_id)
    urls = list(doc.get("notify") or [])
    if not urls:
        return
    summary = {
        "event": "sweep.finished", "sweep_id": sweep_id,
        "name": doc["name"], "playbook": doc["playbook"], "status": doc["status"], "counts": doc["counts"],
        "points": [{k: p[k] for k in ("index", "point", "host", "status", "run_id", "metrics")} for p in doc["points"]],
    }
    db_path = store.path

    def record(url: str, message: str) -> None:
        own = Store(db_path)
        try:
            add_event(own, sweep_id, "warning", f"notify {url}: {message}")
        finally:
            own.close()

    notify.send(urls, summary, record)


def record_cron_skip(entry_id: str, file: Path, message: str) -> None:
    """A nightly run skipped because the previous one still runs: an event on that sweep."""
    ws = Workspace.find()
    store = Store(ws.db_path)
    try:
        sweep_id = None
        try:
            text, _ = _read(Path(file))
            name = load(Path(file)).name
            # the sweep still running: the newest of this file, whatever its instance
            row = store.conn.execute("SELECT MAX(id) FROM sweeps WHERE name = ? AND file_hash = ?",
                                     (name, hashlib.sha256(text.encode()).hexdigest())).fetchone()
            sweep_id = row[0]
        except UsageError:
            pass
        add_event(store, sweep_id, "cron_skip", message, {"entry": entry_id, "file": str(file)})
    finally:
        store.close()


# running ---------------------------------------------------------------------------------------------
class _Stopped(Exception):
    """The point was cancelled (sweep cancel or fail_fast) while it waited."""


class Runner:
    """One controller of one sweep: a thread per lane (host, or GPU set of a host), one point at a time."""

    def __init__(self, ws: Workspace, p: Plan, sweep_id: int, echo: Callable[[str], None],
                 sleep: Callable[[float], None] = time.sleep):
        self.ws, self.plan, self.sweep_id, self.echo, self.sleep = ws, p, sweep_id, echo, sleep
        self.hosts = {h.name: h for h in p.hosts}
        self.errors: list[BaseException] = []
        self._beat = 0.0

    def run(self) -> None:
        lanes: dict[str, list[Point]] = {}
        for pt in self.plan.points:
            lanes.setdefault(pt.lane, []).append(pt)
        threads = [threading.Thread(target=self._lane, args=(pts,), name=f"sweep-{name}", daemon=True)
                   for name, pts in lanes.items()]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():  # short joins: Ctrl-C reaches the main thread
                t.join(0.2)
        if self.errors:
            raise self.errors[0]

    def _lane(self, points: list[Point]) -> None:
        store = Store(self.ws.db_path)
        try:
            for pt in points:
                self._point(store, pt)
        except BaseException as exc:  # noqa: BLE001 - a bug: the main thread re-raises it
            self.errors.append(exc)
        finally:
            store.close()

    # one point ---------------------------------------------------------------------------------
    def _point(self, store: Store, pt: Point) -> None:
        retries = self.plan.file.retries
        tries = 0
        latest = _latest_run(store, self.sweep_id, pt.key)
        if latest is not None:
            v = verdict(latest)
            if v in ("succeeded", "job"):  # finished in an earlier session: never again
                self._set(store, pt, "succeeded" if v == "succeeded" else "failed", run_id=latest.id,
                          fault=None if v == "succeeded" else "job", reason=latest.reason)
                return
            if v == "active":
                ended, watched = self._resume(store, pt, latest)
                if not watched:  # it never launched: the point simply runs again
                    on_run_ended(store, self.sweep_id, pt.index, ended.id)
                elif self._settle(store, pt, ended) == "done":
                    return
                else:
                    tries = 1
        while True:
            if not self._may_start(store, pt):
                return
            try:
                run = self._start_and_watch(store, pt)
            except _Stopped:
                self._set(store, pt, "cancelled", reason="cancelled while waiting")
                return
            except HostKeyError as exc:  # a wrong key or user does not heal on retry
                self._ended(store, pt)
                self._fail(store, pt, "setup", str(exc))
                return
            except Unreachable as exc:
                reason = str(exc)
                self._ended(store, pt)
            except OrchError as exc:
                self._ended(store, pt)
                self._fail(store, pt, "setup", str(exc))
                return
            else:
                if self._settle(store, pt, run) == "done":
                    return
                reason = run.reason or run.status.value
            tries += 1
            if tries > retries:
                self._fail(store, pt, "fleet", f"{reason} (after {tries} attempts)")
                return
            self.echo(f"point {pt.index} ({pt.label}) on {pt.host}: {reason}; retry {tries} of {retries} "
                      f"in {self.plan.file.retry_backoff_s:g} s")
            add_event(store, self.sweep_id, "retry", f"point {pt.index}: {reason}", {"point": pt.index, "try": tries})
            if not self._backoff(store, pt):
                return

    def _start_and_watch(self, store: Store, pt: Point) -> Run:
        told: list[bool] = []

        def on_wait(busy: lease.Busy) -> None:
            if self._cancelled(store, pt):
                raise _Stopped()
            if not told:
                told.append(True)
                self.echo(f"point {pt.index} ({pt.label}) waits: {str(busy).removesuffix('; --queue waits')}")

        pb = self.plan.playbook
        ctx = runflow.start(self.ws, store, pb, pt.spec, self.hosts[pt.host], queue=True, on_wait=on_wait,
                            run_fields={"sweep_id": self.sweep_id, "point": pt.key})
        self.echo(f"point {pt.index} ({pt.label}) on {pt.host}: run {ctx.run_id} started")
        if not self._set(store, pt, "running", run_id=ctx.run_id, unless_cancelled=True):
            self._stop_run(store, ctx.run_id, "sweep cancelled")
        return runflow.watch(ctx, on_update=lambda w: self._heartbeat(store))

    def _resume(self, store: Store, pt: Point, run: Run) -> tuple[Run, bool]:
        """A run left by a dead controller: settle it if it never launched, else watch it to its end.
        Returns the ended run and whether it was watched (False: it never launched)."""
        ctx = runflow.open_run(self.ws, store, run, self.hosts)
        run = runflow.settle_orphan(ctx)
        if run.status is not Status.RUNNING:
            return run, False
        lease.adopt(store, run.id)
        self._set(store, pt, "running", run_id=run.id)
        self.echo(f"point {pt.index} ({pt.label}) on {ctx.host.name}: watching run {run.id} again")
        return runflow.watch(ctx, on_update=lambda w: self._heartbeat(store)), True

    def _settle(self, store: Store, pt: Point, run: Run) -> str:
        """Record how a point's run ended: 'done', or 'retry' when it is the fleet's fault."""
        on_run_ended(store, self.sweep_id, pt.index, run.id)
        v = verdict(run)
        self.echo(f"point {pt.index} ({pt.label}) on {pt.host}: run {run.id} {run.status}"
                  + (f": {run.reason}" if run.reason and v != "succeeded" else ""))
        if v == "succeeded":
            self._set(store, pt, "succeeded", run_id=run.id)
        elif v == "job":
            self._fail(store, pt, "job", run.reason or "failed", run_id=run.id)
            if self.plan.file.fail_fast:
                self._fail_fast(store, pt)
        elif v == "cancelled":
            self._set(store, pt, "cancelled", run_id=run.id, reason=run.reason)
        elif v == "setup":
            self._fail(store, pt, "setup", run.reason or "failed", run_id=run.id)
        else:
            return "retry"
        return "done"

    def _ended(self, store: Store, pt: Point) -> None:
        """A start that failed after its run was created: that run ended too."""
        latest = _latest_run(store, self.sweep_id, pt.key)
        if latest is not None and latest.status.terminal:
            on_run_ended(store, self.sweep_id, pt.index, latest.id)

    # the point's row ---------------------------------------------------------------------------
    def _set(self, store: Store, pt: Point, status: str, *, run_id: int | None = None, fault: str | None = None,
             reason: str | None = None, unless_cancelled: bool = False) -> bool:
        with store.tx() as c:
            if unless_cancelled and self._cancelled(store, pt):
                if run_id is not None:
                    c.execute("UPDATE sweep_points SET run_id = ? WHERE sweep_id = ? AND idx = ?",
                              (run_id, self.sweep_id, pt.index))
                return False
            c.execute("UPDATE sweep_points SET status = ?, fault = ?, reason = ?, run_id = COALESCE(?, run_id)"
                      " WHERE sweep_id = ? AND idx = ?", (status, fault, reason, run_id, self.sweep_id, pt.index))
        return True

    def _fail(self, store: Store, pt: Point, fault: str, reason: str, run_id: int | None = None) -> None:
        self._set(store, pt, "failed", fault=fault, reason=reason, run_id=run_id)
        if fault != "job":
            self.echo(f"point {pt.index} ({pt.label}) on {pt.host} failed: {reason}")

    def _cancelled(self, store: Store, pt: Point) -> bool:
        row = store.conn.execute(
            "SELECT s.status, p.status FROM sweeps s JOIN sweep_points p ON p.sweep_id = s.id"
            " WHERE s.id = ? AND p.idx = ?", (self.sweep_id, pt.index)).fetchone()
        return row[0] == "cancelled" or row[1] == "cancelled"

    def _may_start(self, store: Store, pt: Point) -> bool:
        with store.tx() as c:
            if self._cancelled(store, pt):
                c.execute("UPDATE sweep_points SET status = 'cancelled', reason = COALESCE(reason, 'cancelled')"
                          " WHERE sweep_id = ? AND idx = ?", (self.sweep_id, pt.index))
                return False
            c.execute("UPDATE sweep_points SET status = 'running', attempts = attempts + 1"
                      " WHERE sweep_id = ? AND idx = ?", (self.sweep_id, pt.index))
        return True

    def _backoff(self, store: Store, pt: Point) -> bool:
        """Wait retry_backoff_s; False when the point was cancelled meanwhile."""
        self._set(store, pt, "queued")
        deadline = time.monotonic() + self.plan.file.retry_backoff_s
        while (left := deadline - time.monotonic()) > 0:
            if self._cancelled(store, pt):
                return False
            self.sleep(min(left, 0.5))
        return True

    def _fail_fast(self, store: Store, pt: Point) -> None:
        with store.tx() as c:
            n = c.execute("UPDATE sweep_points SET status = 'cancelled', reason = ? WHERE sweep_id = ?"
                          " AND status = 'queued'", (f"fail_fast: point {pt.index} failed", self.sweep_id)).rowcount
        add_event(store, self.sweep_id, "fail_fast", f"point {pt.index} failed; {n} queued point(s) cancelled")
        self.echo(f"fail_fast: point {pt.index} failed; {n} queued point(s) cancelled")

    def _heartbeat(self, store: Store) -> None:
        now = time.time()
        if now - self._beat >= HEARTBEAT_S:
            self._beat = now
            with store.tx() as c:
                c.execute("UPDATE sweeps SET heartbeat = ? WHERE id = ?", (now, self.sweep_id))

    def _stop_run(self, store: Store, run_id: int, reason: str) -> None:
        runflow.stop_quietly(self.ws, store, run_id, reason, self.hosts)


def _finish(store: Store, sweep_id: int) -> dict[str, Any]:
    with store.tx() as c:
        row = _sweep_row(store, sweep_id)
        statuses = [r[0] for r in c.execute("SELECT status FROM sweep_points WHERE sweep_id = ?", (sweep_id,))]
        status = row["status"]
        if status != "cancelled":
            status = "succeeded" if all(s == "succeeded" for s in statuses) else "failed"
        c.execute("UPDATE sweeps SET status = ?, ended_at = ?, controller = NULL WHERE id = ?",
                  (status, time.time(), sweep_id))
    on_sweep_finished(store, sweep_id)
    return document(store, sweep_id)


def run(ws: Workspace, path: Path, echo: Callable[[str], None] = lambda s: None,
        sleep: Callable[[float], None] = time.sleep, instance: str = "") -> dict[str, Any]:
    """Run (or resume) the sweep in this file (and instance) to its end; returns its status document."""
    store = Store(ws.db_path)
    try:
        p = plan(ws, store, path, instance)
        sweep_id = register(store, p)
        claim(store, sweep_id)
        done = store.conn.execute("SELECT COUNT(*) FROM sweep_points WHERE sweep_id = ? AND (status = 'succeeded'"
                                  " OR fault = 'job')", (sweep_id,)).fetchone()[0]
        add_event(store, sweep_id, "started", f"controller {_me()}; {done} of {len(p.points)} points already done")
        title = f"{p.file.name} {instance}" if instance else p.file.name
        echo(f"sweep {sweep_id} ({title}): {len(p.points)} points on {', '.join(h.name for h in p.hosts)}"
             + (f", {done} already done" if done else ""))
        try:
            Runner(ws, p, sweep_id, echo, sleep).run()
        except KeyboardInterrupt:
            add_event(store, sweep_id, "interrupted", "controller interrupted; running the file again resumes")
            raise
        return _finish(store, sweep_id)
    finally:
        store.close()


def detach(ws: Workspace, path: Path, instance: str = "") -> tuple[int, Path]:
    """Validate and register the sweep, then run its controller as a background process."""
    store = Store(ws.db_path)
    try:
        p = plan(ws, store, path, instance)
        sweep_id = register(store, p)
        _check_not_running(_sweep_row(store, sweep_id))
    finally:
        store.close()
    log = ws.runs_dir / "sweeps" / str(sweep_id) / "controller.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "ORCH_HOME": str(ws.root),
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, "-m", "orchestrator", "--hosts", str(ws.hosts_file), "sweep", "run", str(p.path),
            "--instance", instance]
    with open(log, "ab") as out:
        # its own session: it outlives this command and the terminal it came from
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True)
    return sweep_id, log


def cancel(ws: Workspace, ref: str, grace_s: float = 10.0) -> dict[str, Any]:
    """Cancel the queued points and stop the running ones."""
    store = Store(ws.db_path)
    try:
        sweep_id = resolve(store, ref)
        with store.tx() as c:
            row = _sweep_row(store, sweep_id)
            if row["status"] in ("succeeded", "failed", "cancelled") and not _controller_alive(
                    row["controller"], row["heartbeat"]):
                raise OrchError(f"sweep {sweep_id} already ended ({row['status']})")
            c.execute("UPDATE sweeps SET status = 'cancelled' WHERE id = ?", (sweep_id,))
            queued = c.execute("UPDATE sweep_points SET status = 'cancelled', reason = 'cancelled by user'"
                               " WHERE sweep_id = ? AND status = 'queued'", (sweep_id,)).rowcount
        active = [r[0] for r in store.conn.execute(
            f"SELECT id FROM runs WHERE sweep_id = ? AND pid IS NOT NULL AND status IN ({','.join('?' * len(ACTIVE))})",
            (sweep_id, *[s.value for s in ACTIVE]))]
        stopped = {run_id: runflow.stop_quietly(ws, store, run_id, "sweep cancelled", grace_s=grace_s)
                   for run_id in active}
        with store.tx() as c:
            if not _controller_alive(row["controller"], row["heartbeat"]):
                # nobody else will: every point not finished is cancelled, and the sweep ends here
                c.execute("UPDATE sweep_points SET status = 'cancelled', reason = COALESCE(reason, 'cancelled by user')"
                          " WHERE sweep_id = ? AND status IN ('queued', 'running')", (sweep_id,))
                c.execute("UPDATE sweeps SET ended_at = ?, controller = NULL WHERE id = ?", (time.time(), sweep_id))
        add_event(store, sweep_id, "cancelled", f"{queued} queued point(s) cancelled, {len(stopped)} run(s) stopped")
        return {"sweep_id": sweep_id, "queued_cancelled": queued, "stopped": stopped}
    finally:
        store.close()


# status ----------------------------------------------------------------------------------------------
def document(store: Store, sweep_id: int) -> dict[str, Any]:
    """The JSON shape of a sweep that `orch sweep status --json` prints."""
    row = _sweep_row(store, sweep_id)
    status = row["status"]
    if status == "running" and not _controller_alive(row["controller"], row["heartbeat"]):
        status = "interrupted"  # its controller died: running the file again resumes it
    points = []
    for idx, key, host, gpus, pstatus, fault, reason, attempts, run_id in store.conn.execute(
            "SELECT idx, point, host, gpus, status, fault, reason, attempts, run_id FROM sweep_points"
            " WHERE sweep_id = ? ORDER BY idx", (sweep_id,)):
        run = store.get_run(run_id) if run_id else None
        runs = store.conn.execute("SELECT COUNT(*) FROM runs WHERE sweep_id = ? AND point = ?",
                                  (sweep_id, key)).fetchone()[0]
        points.append({
            "index": idx, "point": json.loads(key), "host": host, "gpus": json.loads(gpus) if gpus else None,
            "status": pstatus, "fault": fault, "reason": reason, "attempts": attempts, "runs": runs,
            "run_id": run_id, "run_status": run.status.value if run else None,
            "metrics": store.latest_metrics(run_id) if run_id else {},
        })
    counts: dict[str, int] = {}
    for pt in points:
        counts[pt["status"]] = counts.get(pt["status"], 0) + 1
    return {
        "id": row["id"], "name": row["name"], "instance": row["instance"], "playbook": row["playbook"],
        "status": status, "path": row["path"],
        "file_hash": row["file_hash"], "created_at": row["created_at"], "ended_at": row["ended_at"],
        "controller": row["controller"], "notify": json.loads(row["notify"] or "[]"), "counts": counts,
        "points": points,
    }


def list_sweeps(store: Store, limit: int = 50) -> list[dict[str, Any]]:
    ids = [r[0] for r in store.conn.execute("SELECT id FROM sweeps ORDER BY id DESC LIMIT ?", (limit,))]
    docs = [document(store, i) for i in ids]
    for d in docs:
        del d["points"]
    return docs


__all__ = [
    "Plan",
    "Point",
    "SweepFile",
    "cancel",
    "detach",
    "document",
    "expand",
    "list_sweeps",
    "load",
    "on_run_ended",
    "on_sweep_finished",
    "plan",
    "record_cron_skip",
    "register",
    "resolve",
    "run",
]
