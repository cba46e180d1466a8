"""The log tail a run page follows, fetched so that no host can hold up the server.

An ended run shows the tail its end step stored (runs/<id>/log.tail). An active run's is asked of its
host through the run flow, in a few worker threads of our own: a page waits at most `wait_s` for it and
otherwise gets the last tail fetched (marked pending), a run is never asked twice at once, and a tail
younger than `fresh_s` is served again, so ten open tabs cost one SSH call a second, not ten.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from .. import runflow
from ..config.hosts import Inventory
from ..config.workspace import Workspace
from ..errors import OrchError
from ..logparse.text import strip_ansi
from ..store import Store
from ..store.record import RunRecord

MAX_LINES = 1000
MAX_BYTES = 256 << 10
CACHED_RUNS = 256


def last_lines(text: str, lines: int) -> str:
    text = strip_ansi(text[-MAX_BYTES:]).replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(text.splitlines()[-lines:])


def stored_tail(ws: Workspace, run_id: int) -> tuple[str, float] | None:
    """The tail the run's end step wrote, its last MAX_BYTES, and when it was written."""
    path = ws.runs_dir / str(run_id) / "log.tail"
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - MAX_BYTES))
            return f.read().decode("utf-8", "replace"), path.stat().st_mtime
    except OSError:
        return None


class LogTails:
    def __init__(self, ws: Workspace, workers: int = 4, wait_s: float = 3.0, fresh_s: float = 1.0):
        self.ws, self.wait_s, self.fresh_s = ws, wait_s, fresh_s
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="orch-ui-log")
        self._lock = threading.Lock()
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._cache: OrderedDict[int, dict[str, Any]] = OrderedDict()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def tail(self, store: Store, run: RunRecord, lines: int) -> dict[str, Any]:
        """{text, source: stored | host | none, at, pending, error}: the log's last `lines` lines."""
        lines = max(1, min(lines, MAX_LINES))
        if run.status.terminal or not run.launched:
            stored = stored_tail(self.ws, run.id)
            if stored is not None:
                return {"text": last_lines(stored[0], lines), "source": "stored", "at": stored[1],
                        "pending": False, "error": None}
            if not run.launched:
                return {"text": "", "source": "none", "at": None, "pending": False, "error": None}
            # ended without a stored tail (its end step failed): the host may still have the log
        with self._lock:
            cached = self._cache.get(run.id)
            if cached and cached["lines"] >= lines and time.time() - cached["at"] < self.fresh_s:
                return cached
            future = self._pending.get(run.id)
            if future is None:
                future = self._pool.submit(self._fetch, store, run, lines)
                self._pending[run.id] = future
        try:
            return future.result(timeout=self.wait_s)
        except FutureTimeout:
            stale = cached or {"text": run.last_line or "", "source": "host", "at": None, "error": None}
            return {**stale, "pending": True}

    def _fetch(self, store: Store, record: RunRecord, lines: int) -> dict[str, Any]:
        # open_run is given the record itself, so this thread never uses the caller's connection
        try:
            run = runflow.open_run(self.ws, store, record, Inventory.load(self.ws.hosts_file, self.ws.root), any_spec=True)
            found: dict[str, Any] = {"text": last_lines(run.executor.tail(run.paths, lines), lines), "error": None}
        except OrchError as exc:  # an unreachable host, a vanished run dir: said on the page
            found = {"text": record.last_line or "", "error": str(exc)}
        finally:
            with self._lock:
                self._pending.pop(record.id, None)
        found.update(source="host", at=time.time(), lines=lines, pending=False)
        with self._lock:
            self._cache[record.id] = found
            self._cache.move_to_end(record.id)
            while len(self._cache) > CACHED_RUNS:
                self._cache.popitem(last=False)
        return found
