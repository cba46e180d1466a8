"""LogParser: raw log bytes in; engine, phase, progress, error and metrics out; resumable from a dict."""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from . import bench, generic, sglang, slurm, speculators, trainers, vllm
from .errorfinder import CONTEXT_BEFORE, CONTEXT_LINE_CHARS, ErrorFinder
from .errors import (
    LogError,
)
from .formats import Screen, release
from .protocol import PROGRESS, protocol_progress
from .readings import Metric, Readings, RowReader
from .text import Line, LineSplitter, RichUnwrapper, clean
from .tqdm import (
    Progress,
    has_total,
    match_bar_at,
    progress_of,
    redraw_line,
    redraw_run,
    run_by_shapes,
    search_bar,
)
from .traceback import TracebackTracker

PHASES = ("starting", "loading", "capturing", "ready", "running", "finished", "failed")

STATE_VERSION = 3
_MAX_BAR_PREFIX = 1000  # a longer label is no tqdm desc worth remembering

# Most specific first: an engine may only be replaced by one earlier in this list.
_DETECTION: list[tuple[str, re.Pattern[str] | Screen]] = [
    ("speculators", speculators.DETECT),
    ("sglang", sglang.DETECT),
    ("vllm", vllm.DETECT),
    ("transformers", generic.DETECT_TRANSFORMERS),
    ("slurm", slurm.DETECT),  # the scheduler's own lines: the engine only when nothing else is known
]
_MODULES: dict[str | None, ModuleType] = {
    "sglang": sglang,
    "vllm": vllm,
    "speculators": speculators,
    "transformers": generic,
    "generic": generic,
    "slurm": generic,
}
# A stop was asked for (SIGTERM, SIGINT): the server's own word, or uvicorn's in front of it. What breaks while
# it shuts down (an engine's output handler finding its engine gone) is how it stopped, not why.
_SHUTDOWN = (vllm.SHUTDOWN, sglang.SHUTDOWN, generic.SHUTDOWN)
_MAX_RICH = 64  # processes whose Rich records (and result blocks) are followed at once
_MAX_GLUED = 8  # lines read out of one physical line after the bars glued in front of them
# Engines whose own words outweigh the line layout of another.
_OVER_LAYOUT = ("speculators", "sglang", "vllm")
# Engines that load one model's shards with one bar: a second shard bar in the same load is a draft's.
_ONE_LOAD_BAR = ("vllm", "speculators")
# A server that answers: uvicorn's start lines, or an access-log line with a success status. A server that
# is alive: an access-log line of any status but a server error's (one whose status a pane clipped off too).
_SERVING = re.compile(r"Application startup complete\.|Uvicorn running on|HTTP/[\d.]+\" 2\d\d\b")
_ANSWERED = re.compile(r"\"[A-Z]{3,7} /\S*(?: HTTP(?:/[\d.]*)?(?:\" [1-4]\d\d\b|\"?\s*$)|\s*$)")
_DONE = Screen(trainers.DONE,
               ("finish", "complete", "done", "ended", "train_runtime", "trainer.fit", "after training", "train metrics",
                "exit"))


def _plain_prefix(prefix: str, with_total: bool) -> bool:
    """Whether lines starting with this bar label reach the parser unchanged by clean(), so runs of
    them may be taken as raw bytes."""
    if prefix[:1] in ("(", "[") or " - " in prefix or "\x1b" in prefix or (not with_total and "%" in prefix):
        return False
    return not prefix.lstrip().startswith(("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"))


def assumption(engine: str | None, version: str | None) -> str | None:
    """One line saying what orch assumes of an engine version its tables were not taken from; None for a
    version it knows (or an engine it has no tables for)."""
    module = {"sglang": sglang, "vllm": vllm}.get(engine or "")
    got = release(version) if version else ()
    if module is None or not got:
        return None
    low, high = module.KNOWN
    if got < release(low):
        return f"{engine} {version} is older than orch knows ({low} to {high}): its lines are read as {low}'s"
    if got[:len(release(high))] > release(high):
        return f"{engine} {version} is newer than orch knows ({low} to {high}): its lines are read as {high}'s"
    return None


class LogParser(ErrorFinder, Readings):
    """Follows one log as it grows. Feed it bytes in any chunks; the state depends only on the bytes."""

    def __init__(self, engine: str | None = None, ready_pattern: str | None = None,
                 readers: Sequence[RowReader] = (), engine_version: str | None = None) -> None:
        self.engine: str | None = engine
        # the installed engine's version, when the run's playbook looked: it names what a layout does not tell
        self.engine_version: str | None = None
        self._release: tuple[int, ...] = ()
        self._set_version(engine_version)
        self.auto_engine = engine is None
        self._by_layout = False  # the engine was named only by the layout of its lines
        self.ready_pattern = ready_pattern
        self._ready_re = re.compile(ready_pattern) if ready_pattern else None
        self.phase = "starting"
        self.phases_passed: list[str] = []  # every phase entered since the caller last emptied it
        self._progress: Progress | None = None
        self._pending: re.Match[str] | None = None  # latest redraw, turned into Progress when asked for
        # The last bar, so its redraws are recognised cheaply: [text before it, has a total, engine, phase].
        self._bar: list[Any] | None = None
        self._partial: tuple[bytes, Progress | None] | None = None  # parsed unfinished line, by identity
        # Compiled for self._bar: its label, whether it has a total, the run and the line patterns, the
        # label's bytes, whether the label has digits.
        self._run_re: tuple[str, bool, re.Pattern[bytes], re.Pattern[bytes], bytes, bool] | None = None
        self.error: LogError | None = None
        self.metrics: dict[str, float] = {}
        self.lines = 0
        self._splitter = LineSplitter()
        self._tracebacks = TracebackTracker()
        self._recent: deque[str] = deque(maxlen=CONTEXT_BEFORE)
        self._error_after = 0  # lines still to add after the error to its context
        self._error_progress: list[Any] | None = None  # [label, done] when the error was seen
        # One per writing process: two ranks' Rich records may be interleaved line by line.
        self._rich: dict[str, RichUnwrapper] = {}
        # Rows read of the result block each process is printing (ranks' blocks may be interleaved).
        self._bench: dict[str, int] = {}
        self._load_begin: str | None = None  # time of the last 'Load weight begin' line, as printed
        self._caught = False  # the error is a complete traceback that something caught
        self._failed_in: str | None = None  # the phase the run failed in
        self._stopping = False  # a stop was asked for: what fails from here on is no cause
        self.cpu = False  # the engine runs on the CPU (vLLM's CPU backend): hints name its knobs
        self.url: str | None = None  # where the server said it serves
        self._loaded: list[str] = []  # processes whose target weights are loaded: a later load is a draft's
        self._shards: list[float | None] | None = None  # [done, total] of the load's shard bar (vLLM)
        # [completed, failed] requests of the benchmark result blocks so far (one job may run several)
        self.requests: list[float] | None = None
        self.blocks = 0  # benchmark result blocks begun so far: a job that repeats its benchmark prints one each
        self._more = 0  # lines after a pydantic ValidationError still to add to its message (its reasons)
        self._answered_during = False  # a request was answered while a traceback was being written
        self.readers = tuple(readers)  # plugins' readings of their own lines; not state
        self.rows: list[tuple[str, dict[str, Any]]] = []  # (table, row) since the last take_rows(); not state
        self._redrawn: list[Metric] = []  # postfix samples of bars redrawn in place, for feed() to return
        self._cut_line = False  # reading the line the log ends in without its line end; not state

    # ---- input ----------------------------------------------------------------------------------

    def feed(self, data: bytes) -> list[Metric]:
        """Consume the next bytes of the log; return the metric samples of the lines they complete."""
        found: list[Metric] = []
        for raw, by_cr in self._splitter.feed(data, self._skip_redraws):
            self._line(raw, by_cr, found)
        found += self._redrawn
        self._redrawn = []
        return found

    def finish(self, exit_code: int | None = None) -> list[Metric]:
        """End of the log: a trailing partial line counts as complete. `exit_code`, when the caller knows
        how the process ended, decides a tentative error that nothing followed (else the log alone does)."""
        found: list[Metric] = []
        for raw, by_cr in self._splitter.finish():
            self._cut_line = not by_cr  # the log ends inside this line: it may have been cut anywhere
            self._line(raw, by_cr, found)
            self._cut_line = False
        for source, rich in self._rich.items():
            for piece in rich.flush():
                self._rich_piece(piece, found, source)
        for cut in self._tracebacks.cut_at_end():
            self._cut(cut, Line("", "", "", None))
        found += self._redrawn
        self._redrawn = []
        if exit_code != 0:
            self._last_word()
        if self.engine is None:
            self.engine = "generic"
        return found

    # ---- one line -------------------------------------------------------------------------------

    @property
    def progress(self) -> Progress | None:
        """Latest progress bar, including the one being drawn now (tqdm's current line is unfinished)."""
        return self._partial_bar() or self._last_bar()

    @property
    def stopping(self) -> bool:
        """A stop was asked for (the server's or uvicorn's word): what fails from here on is no cause."""
        return self._stopping

    def _last_bar(self) -> Progress | None:
        if self._pending is not None:
            self._progress = progress_of(self._pending)
            self._pending = None
        return self._progress

    def _partial_bar(self) -> Progress | None:
        buf = self._splitter.buf
        if not buf or b"[" not in buf:
            return None
        if self._partial is None or self._partial[0] is not buf:
            text = clean(buf.decode("utf-8", "replace")).text
            m = search_bar(text)
            self._partial = (buf, progress_of(m) if m is not None and not text[m.end():].strip() else None)
        return self._partial[1]

    def _line(self, raw: bytes, by_cr: bool, found: list[Metric]) -> None:
        decoded = raw.decode("utf-8", "replace")
        if by_cr and (not decoded or decoded.isspace()):
            return  # what sits in front of a tqdm redraw's '\r': no line of its own
        line = clean(decoded)
        # Rich's columns are the program's own: they are looked for behind a launcher's or collector's prefix.
        rich = self._rich.get(line.source)
        if (rich is not None and rich.piece is not None) or line.body[-1:].isdigit():
            if rich is None:
                rich = RichUnwrapper()
            pieces, plain = rich.feed(line.body.rstrip())
            if rich.piece is not None and line.source not in self._rich:  # a record begins: follow it
                self._rich[line.source] = rich
                if len(self._rich) > _MAX_RICH:
                    del self._rich[next(iter(self._rich))]
            for piece in pieces:
                self._rich_piece(piece, found, line.source)
            if not plain:
                return
        if by_cr and (not line.text or line.text.isspace()):
            return
        self.lines += 1
        self._take(line, found)

    def _rich_piece(self, piece: tuple[str, str, str, int], found: list[Metric], source: str = "") -> None:
        """One line of a Rich record's message, joined from the physical lines Rich wrapped it into."""
        text, raw, level, physical = piece
        self.lines += 1
        self._take(Line(text=text, raw=raw, source=source, level=level), found)
        self.lines += physical - 1

    def _take(self, line: Line, found: list[Metric]) -> None:
        if self._more > 0:
            self._reason(line)
        if not self._redraw(line):
            self._other(line, found)
        if self._ready_re is not None and self._ready_re.search(line.raw):
            self._set_phase("ready")
        self._remember(line.raw)

    def _redraw(self, line: Line) -> bool:
        """Take a line that only redraws the last bar: a 100 MB run of them must go fast."""
        bar = self._bar
        err = self.error
        text = line.text
        if bar is None or bar[2] != self.engine or line.level or (err is not None and not err.fatal):
            return False
        if bar[3] == "loading" and self.engine in _ONE_LOAD_BAR:
            return False  # each line is looked at: a draft's bar of the same label may follow (a few lines)
        if not text.startswith(bar[0]) or (not bar[1] and "%" in text):
            return False
        m = match_bar_at(text, len(bar[0]), bar[1])
        if m is None:
            return False
        self._pending = m
        if bar[3] is not None:
            self._set_phase(bar[3])
        if self._tracebacks.open:
            self._feed_traceback(line)
        if "=" in m.group("postfix"):
            self._redrawn += self._postfix(m, line)
        return True

    def _skip_redraws(self, data: bytes, start: int, end: int) -> int:
        """Take a run of lines that only redraw the last bar at C speed; same effect as one by one."""
        bar = self._bar
        if bar is None or not bar[4] or (bar[3] == "loading" and self.engine in _ONE_LOAD_BAR):
            return start
        prefix, with_total = bar[0], bar[1]
        run = self._run_re
        if run is None or run[0] != prefix or run[1] != with_total:
            # (compiled once per bar: most calls are at a line that is no redraw, and end at startswith)
            run = self._run_re = (prefix, with_total, redraw_run(prefix, with_total), redraw_line(prefix, with_total),
                                  prefix.encode(), any(c.isdigit() for c in prefix))
        if not data.startswith(run[4], start):
            return start
        tentative = self.error is not None and not self.error.fatal
        if (bar[2] != self.engine or self._tracebacks.open or self._error_after
                or tentative or any(r.piece is not None for r in self._rich.values())):
            return start
        found = run_by_shapes(data, start, end, run[3]) if not run[5] else None
        if found is None:
            m = run[2].match(data, start, end)
            if m is None:
                return start
            found = m.end(), data.count(b"\r", start, m.end())
        stop, count = found
        if self._ready_re is not None and self._ready_in(data[start:stop - 1]):
            return start  # the ready line is one of them: one by one, so that it is seen where it is
        # The last CONTEXT_BEFORE lines of the run are all that outlives it: split off the end of the run
        # that holds them (its lines are alike in length), else off the whole run.
        lo = max(start, stop - 1 - 2 * CONTEXT_BEFORE * ((stop - start) // count + 1))
        pieces = data[lo:stop - 1].split(b"\r")
        if lo > start:
            del pieces[0]  # cut anywhere: part of a line
            if len(pieces) < CONTEXT_BEFORE:
                pieces = data[start:stop - 1].split(b"\r")
        tail = [piece.decode("utf-8", "replace") for piece in pieces[-CONTEXT_BEFORE:]]
        last = match_bar_at(tail[-1], len(prefix), with_total)
        if last is None:
            return start
        self.lines += count
        self._pending = last
        if bar[3] is not None:
            self._set_phase(bar[3])
        self._recent.extend(t[:CONTEXT_LINE_CHARS] for t in tail)
        if "=" in last.group("postfix"):
            self._redrawn += self._postfix(last, Line(tail[-1], tail[-1], "", None))
        return stop

    def _ready_in(self, run: bytes) -> bool:
        """Whether a redraw of a run matches the ready pattern (each looked at as its own line would be)."""
        ready = self._ready_re
        assert ready is not None
        return any(ready.search(piece) for piece in run.decode("utf-8", "replace").split("\r"))

    def _other(self, line: Line, found: list[Metric], glued: int = 0) -> None:
        text = line.text
        m = search_bar(text)
        pure_bar = m is not None and not text[m.end():].strip()
        if m is not None and not pure_bar and glued < _MAX_GLUED:
            # A redraw, then another line where no line break came between them (a logger writing while
            # tqdm's line was unfinished, or a pasted terminal): the bar, then that line read on its own.
            bar = Line(text[:m.end()], line.raw, line.source, line.level, line.stamp, line.layout, line.body)
            self._other(bar, found, _MAX_GLUED)
            rest = clean(text[m.end():].lstrip())
            rest.source = line.source + rest.source
            self._other(rest, found, glued + 1)
            return
        if self.auto_engine:
            if line.layout is not None:
                self._detect_name(line.layout, layout=True)
            self._detect(text[:m.start()] if m is not None and pure_bar else text)
        if m is not None:
            self._on_progress(m, pure_bar)
            if "=" in m.group("postfix"):
                found += self._postfix(m, line)
            for name, value in trainers.label_metrics(text[:m.start()]):
                self._sample(name, value, line, found)
        if pure_bar:
            # A bar line carries nothing else, but it ends any traceback it interrupts.
            self._feed_traceback(line)
            return
        self._server_state(line)
        self._metrics(line, found)
        told = protocol_progress(text) if PROGRESS in text else None
        if told is not None:
            label, done, total = told
            percent = round(min(done / total, 1.0) * 100, 4) if total else None
            self._progress, self._pending = Progress(label, done, total, percent, None, None, None), None
            self._healthy()  # the job is alive and reporting
            if self.phase in ("starting", "loading"):
                self._set_phase("running")
        keras = trainers.keras_bar(text) if m is None else None
        if keras is not None:
            done, total, pairs = keras
            self._progress, self._pending = Progress("step", done, total, round(done / total * 100, 4),
                                                     None, None, None), None
            for name, value in pairs:
                self._sample(name, value, line, found)
            self._healthy()  # a trainer that reports its steps is alive
            if self.phase in ("starting", "loading"):
                self._set_phase("running")
        epochs = speculators.epoch_progress(text)
        if epochs is not None:
            done, total = epochs
            self._progress, self._pending = Progress("epoch", done, total, round(done / total * 100, 4),
                                                     None, None, None), None
            self._set_phase("running")
        for reader in self.readers:
            if reader.marker in text:
                row = reader.read(text)
                if row is not None:
                    self.rows.append((reader.table, {**row, "line": self.lines}))
        self._phase_of(line)
        self._find_error(line)

    def _server_state(self, line: Line) -> None:
        """What a server's lines say of it besides its phase: a stop asked for, the CPU backend, its address,
        a model load beginning (vLLM)."""
        text = line.text
        if any(p.search(text) for p in _SHUTDOWN):
            self._stopping = True
            if vllm.SHUTDOWN.search(text):
                self._group_stopped()
        if self.engine in ("vllm", "speculators") or "vllm" in line.raw.lower():
            if not self.cpu and vllm.on_cpu(line.raw):
                self.cpu = True
            url = vllm.url_of(text)
            if url is not None:
                self.url = url
            if self.engine_version is None:  # the playbook did not look: the engine says it as it starts
                self._set_version(vllm.version_of(text))
            if vllm.LOAD_BEGIN in text:
                self._stopping = False  # a new server starts in this log
                self._shards = None
                if line.source in self._loaded:
                    self._loaded.remove(line.source)

    def _set_version(self, version: str | None) -> None:
        if version is not None:
            self.engine_version, self._release = version, release(version)

    def _phase_of(self, line: Line) -> None:
        text = line.text
        phase = _MODULES.get(self.engine, generic).line_phase(text, self.phase)
        if self.phase in ("loading", "capturing", "ready", "running") and _SERVING.search(text):
            if phase is None and self.phase in ("loading", "capturing"):
                phase = "ready"  # the server answers: after its weights and graphs, that is all it waits for
            self._healthy()  # a server that still answers was not killed by a request's traceback
            self._answered_during = bool(self._tracebacks.open)
        elif "\"" in text and _ANSWERED.search(text):
            self._healthy()
            self._answered_during = bool(self._tracebacks.open)
        if phase is None and _DONE.search(text):
            phase = "finished"
        if phase is None:
            phase = self._bench_block(text, line.source)
        if phase is not None:
            if phase in ("ready", "running", "finished"):
                self._healthy()
            self._set_phase(phase)

    def _bench_block(self, text: str, source: str) -> str | None:
        """A benchmark's result block: 'finished' once it begins (it is printed when the benchmark is done),
        its rows read until it closes."""
        if bench.header(text):
            self._bench[source] = 0
            self.blocks += 1
            if len(self._bench) > _MAX_RICH:
                del self._bench[next(iter(self._bench))]
            return "finished"  # the block is printed once the benchmark is done: a cut block was done too
        if source in self._bench:
            if bench.end(text):
                done = self._bench.pop(source) > 0
                return "finished" if done else None
            if self.auto_engine and (tool := bench.engine_of(text.strip())) is not None:
                self._detect_name(tool)
            self._bench[source] += 1
        return None

    # ---- state changes --------------------------------------------------------------------------

    def _detect(self, text: str) -> None:
        for name, pattern in _DETECTION:
            if name == self.engine and not self._by_layout:
                return  # only a more specific engine may take over
            if pattern.search(text):
                if name == self.engine:
                    self._by_layout = False  # its own words confirm what its line layout said
                    return
                # An engine's own words outweigh another engine's line layout (a prefix of that shape).
                if self.engine is None or not self._by_layout or name in _OVER_LAYOUT or self._before(name):
                    self.engine, self._by_layout = name, False
                    return

    def _before(self, name: str) -> bool:
        """Whether `name` comes before the current engine in the detection order (is more specific)."""
        for known, _ in _DETECTION:
            if known == self.engine:
                return False
            if known == name:
                return True
        return False

    def _detect_name(self, name: str, layout: bool = False) -> None:
        """An engine named by its own line layout (`layout`: only as long as no engine's words say
        otherwise) or by a tool's line, with the same precedence as by content."""
        # A layout does not outweigh an engine named already, by its words or by another layout (a launcher's
        # prefix of one engine's shape in front of another's lines); only a trainer or Slurm's lines.
        if self.engine is None or (self._before(name) and not (layout and self.engine in _OVER_LAYOUT)):
            self.engine, self._by_layout = name, layout
        elif name == self.engine and not layout:
            self._by_layout = False

    def _on_progress(self, m: re.Match[str], pure_bar: bool) -> None:
        progress = progress_of(m)
        if self.engine in _ONE_LOAD_BAR and generic.common_bar_phase(progress.label) == "loading":
            shards = self._shards
            if shards is not None and (progress.total != shards[1] or progress.done < (shards[0] or 0)):
                return  # another bar in the same load: a draft's (EAGLE-3, MTP); the target's stays the progress
            self._shards = [progress.done, progress.total]
        err = self.error
        if (err is not None and not err.fatal and progress.done > 0
                and self._error_progress != [progress.label, progress.done]):
            self._healthy()
        self._progress, self._pending = progress, None
        module = _MODULES.get(self.engine, generic)
        phase = generic.common_bar_phase(progress.label) or module.bar_phase(progress.label)
        if phase is None and (trainers.training_postfix(m.group("postfix")) or trainers.label_metrics(progress.label)):
            phase = "running"  # a training loop's bar, whichever program's log it is in
        if phase is not None:
            self._set_phase(phase)
        if pure_bar and m.start() <= _MAX_BAR_PREFIX:
            prefix = m.string[:m.start()]
            self._bar = [prefix, has_total(m), self.engine, phase, _plain_prefix(prefix, has_total(m))]

    def _set_phase(self, phase: str) -> None:
        if self.phase == "failed" or (self.phase == "finished" and phase != "failed"):
            return
        if phase != self.phase:
            self.phases_passed.append(phase)
        if phase == "failed":
            self._failed_in = self.phase
        self.phase = phase

    # ---- persistence ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "engine": self.engine,
            "auto_engine": self.auto_engine,
            "by_layout": self._by_layout,
            "ready_pattern": self.ready_pattern,
            "engine_version": self.engine_version,
            "phase": self.phase,
            "progress": p.to_dict() if (p := self._last_bar()) else None,
            "error": self.error.to_dict() if self.error else None,
            "metrics": dict(self.metrics),
            "lines": self.lines,
            "bar": self._bar,
            "splitter": self._splitter.to_dict(),
            "tracebacks": self._tracebacks.to_dict(),
            "recent": list(self._recent),
            "error_after": self._error_after,
            "error_progress": list(self._error_progress) if self._error_progress is not None else None,
            "rich": {source: rich.to_dict() for source, rich in self._rich.items()},
            "bench": dict(self._bench),
            "load_begin": self._load_begin,
            "caught": self._caught,
            "failed_in": self._failed_in,
            "stopping": self._stopping,
            "cpu": self.cpu,
            "url": self.url,
            "loaded": list(self._loaded),
            "shards": self._shards,
            "requests": self.requests,
            "blocks": self.blocks,
            "more": self._more,
            "answered_during": self._answered_during,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], readers: Sequence[RowReader] = ()) -> LogParser:
        p = cls(engine=d.get("engine"), ready_pattern=d.get("ready_pattern"), readers=readers,
                engine_version=d.get("engine_version"))
        p.auto_engine = bool(d.get("auto_engine", p.engine is None))
        p._by_layout = bool(d.get("by_layout", False))
        p.phase = d.get("phase", "starting")
        p._progress = Progress.from_dict(d["progress"]) if d.get("progress") else None
        p._bar = d.get("bar")
        p.error = LogError.from_dict(d["error"]) if d.get("error") else None
        # a NaN stored in strict JSON comes back as null: it was a number, not nothing
        p.metrics = {k: math.nan if v is None else v for k, v in d.get("metrics", {}).items()}
        p.lines = int(d.get("lines", 0))
        p._splitter = LineSplitter.from_dict(d.get("splitter", {}))
        p._tracebacks = TracebackTracker.from_dict(d.get("tracebacks", {}))
        p._recent = deque(d.get("recent", []), maxlen=CONTEXT_BEFORE)
        p._error_after = int(d.get("error_after", 0))
        p._error_progress = d.get("error_progress")
        rich = d.get("rich", {})
        if "col" in rich:  # one unwrapper, as stored before there was one per process
            rich = {"": rich}
        p._rich = {source: RichUnwrapper.from_dict(r) for source, r in rich.items()}
        blocks = d.get("bench", {})
        # Stored before blocks were followed per process: the rows read, -1 outside one.
        p._bench = {"": blocks} if isinstance(blocks, int) and blocks >= 0 else dict(blocks or {})
        p._load_begin = d.get("load_begin")
        p._caught = bool(d.get("caught", False))
        p._failed_in = d.get("failed_in")
        p._stopping = bool(d.get("stopping", False))
        p.cpu = bool(d.get("cpu", False))
        p.url = d.get("url")
        p._loaded = list(d.get("loaded", []))
        p._shards = d.get("shards")
        p.requests = d.get("requests")
        p.blocks = int(d.get("blocks", 0))
        p._more = int(d.get("more", 0))
        p._answered_during = bool(d.get("answered_during", False))
        return p
