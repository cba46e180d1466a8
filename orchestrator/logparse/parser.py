"""LogParser: raw log bytes in; engine, phase, progress, error and metrics out; resumable from a dict."""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

from . import bench, generic, sglang, slurm, speculators, trainers, vllm
from .errors import (
    CHAIN_CHARS,
    CHAIN_MAX,
    COMMON_RULES,
    CUT_MESSAGE,
    HARMLESS,
    RANK,
    LogError,
    classify,
    exception_kind,
    exception_line,
    merge,
)
from .formats import Screen, release
from .hints import hint_of
from .protocol import PROGRESS, PROTOCOL, protocol_metrics, protocol_progress
from .text import Line, LineSplitter, RichUnwrapper, clean, stamp_seconds
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
from .traceback import HEADER_START, Cut, ExceptionEnd, TracebackTracker

PHASES = ("starting", "loading", "capturing", "ready", "running", "finished", "failed")

STATE_VERSION = 3
CONTEXT_BEFORE = 20  # lines kept before an error: enough for the end of a traceback
CONTEXT_AFTER = 5
CONTEXT_LINE_CHARS = 500
MESSAGE_CHARS = 2000
MORE_LINES = 4  # lines after an error that may hold its reasons (pydantic's)
# Errors whose reasons follow on their own indented lines: pydantic's '1 validation error for ModelConfig'.
_REASONS_FOLLOW = re.compile(r"ValidationError: \d+ validation errors? for ")
_FIELD = re.compile(r"^[A-Za-z_][\w.\[\]]{0,200}$")  # the field a pydantic reason is about
# A tentative error this many lines old is unrelated to a new one.
STALE_LINES = 200
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
# Markers are distinctive enough to be looked for whatever the engine.
_RULES = COMMON_RULES + sglang.RULES + vllm.RULES + speculators.RULES + slurm.RULES
# Every rule's pattern holds one of these words (case aside): a test checks it on every rule's transcripts.
_ANY_RULE = Screen(re.compile("|".join(f"(?:{r.pattern.pattern})" for r in _RULES)), (
    "memory", "cuda error", "cuda driver", "cudaerror", "cublas", "cudnn", "illegal", "assert", "kill",
    "exit", "sig", "nccl", "backend", "watchdog", "childfailed", "fatal", "segmentation", "dumped", "terminate",
    "max seq len", "stored in kv cache", "kv cache is needed", "derived max_model_len", "hunk", "patch",
    "exception", "scheduler", "crashed", "warmup", "fail", "encountered", "dead", "died", "externally held",
    "aborting", "cancelled", "srun", "slurmstepd"))
# Markers that count whatever level they are logged at (or that come from programs that print no level).
_ANY_LEVEL = Screen(re.compile("|".join(f"(?:{r.pattern.pattern})" for r in _RULES if r.any_level)),
                    ("cancelled", "srun", "slurmstepd", "engine core exited", "hunk", "patch", "exit",
                     "kill", "death signal", "got signal"))
# A stop was asked for (SIGTERM, SIGINT): the server's own word, or uvicorn's in front of it. What breaks while
# it shuts down (an engine's output handler finding its engine gone) is how it stopped, not why.
_SHUTDOWN = (vllm.SHUTDOWN, sglang.SHUTDOWN, generic.SHUTDOWN)
_MAX_RICH = 64  # processes whose Rich records (and result blocks) are followed at once
_MAX_GLUED = 8  # lines read out of one physical line after the bars glued in front of them
_LAST_NUMBER = re.compile(r"-?[\d.]+(?:[eE][-+]?\d*)?\s*$")
# Engines whose own words outweigh the line layout of another.
_OVER_LAYOUT = ("speculators", "sglang", "vllm")
_METRIC_SOURCES = (sglang.metrics, vllm.metrics)
# Engines that load one model's shards with one bar: a second shard bar in the same load is a draft's.
_ONE_LOAD_BAR = ("vllm", "speculators")
_HEALTHY_METRICS = {"gen_throughput", "train/loss", "loss", "step"}
_QUIET_LEVELS = {"DEBUG", "INFO", "WARNING"}
_LOUD_LEVELS = {"ERROR", "CRITICAL"}
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


class RowReader(Protocol):
    """A plugin's reading of its own lines (store/runtables.LineReader is one): each line, cleaned as the parser
    reads it, that holds `marker` is handed to `read`; a row it returns goes to the table `table`, with the
    line's number."""

    @property
    def table(self) -> str: ...

    @property
    def marker(self) -> str: ...

    @property
    def read(self) -> Callable[[str], dict[str, Any] | None]: ...


@dataclass
class Metric:
    name: str
    value: float
    line: int
    stamp: str | None = None  # the line's own time as printed, when it shows one (see text.stamp_time)
    repeat: int | None = None  # a benchmark result row: which result block (repeat) of the log, from 1


class LogParser:
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

    def _last_word(self) -> None:
        """At the end of the log: a tentative error that nothing healthy followed ended the run.

        Fatal or survivable is decided by what follows an error. Healthy work after it (a bar that moves on,
        decode statistics, answered requests, the ready line, metrics) shows it was survived and clears it.
        When the log ends first, a traceback cut short, an exception line or an engine's warning of trouble is
        how the run ended: the process exited, or the other ranks stopped with it. A complete traceback that
        something caught (its outermost frame is no top level) is survived unless the log says more.
        """
        err = self.error
        if err is None or err.fatal or self._caught or self.phase == "finished" or self._stopping:
            return  # (a stop was asked for after it: the server was stopped, whatever it had survived)
        if self.lines - err.line > STALE_LINES:
            return
        err.fatal = True
        self._set_phase("failed")

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

    def _group_stopped(self) -> None:
        """The API server was signalled: a stop of the whole process group, whose engine core may have gone
        a moment before it (the client's 'engine core exited unexpectedly' then): no kill, a stop."""
        err = self.error
        if err is None or err.kind != "killed" or vllm.CORE_EXITED not in err.message:
            return
        self.error, self._error_after, self._caught = None, 0, False
        if self.phase == "failed":
            self.phase, self._failed_in = self._failed_in or "running", None

    def _target_load(self, line: Line) -> bool:
        """Whether a vLLM 'Loading weights took' line is the target model's: the first of its process since
        its load began. A draft's (EAGLE-3, MTP) or the hidden-states extractor's follows it, and its bar is
        not the run's progress."""
        if line.source in self._loaded:
            return False
        self._loaded.append(line.source)
        del self._loaded[:-_MAX_RICH]
        return True

    def take_rows(self) -> list[tuple[str, dict[str, Any]]]:
        """The plugins' rows read since the last call, as (table, row), in the log's order."""
        taken, self.rows = self.rows, []
        return taken

    def _postfix(self, m: re.Match[str], line: Line) -> list[Metric]:
        """A bar's postfix metrics (Lightning's 'loss=2.61, v_num=0'); of a run of redraws taken at once,
        the last redraw's."""
        found: list[Metric] = []
        for name, value in trainers.postfix_metrics(m.group("postfix")):
            self._sample(name, value, line, found)
        return found

    def _metrics(self, line: Line, found: list[Metric]) -> None:
        text = line.text
        if self._cut_line:
            text = _LAST_NUMBER.sub("", text)  # '... acc=0.61' may have been '0.612' before the cut
        for source in _METRIC_SOURCES:
            for name, value in (sglang.metrics(text, self._release) if source is sglang.metrics else source(text)):
                if name == "load_weight_s" and vllm.LOAD_END.search(text) and not self._target_load(line):
                    continue  # a draft's load, after the target's
                self._sample(name, value, line, found)
                if name in _HEALTHY_METRICS:
                    self._healthy()
        # a line that states its metrics in orch's own words is read by those words only: its prefix
        # ('step 3 orch-metric loss=1.5') must not give the same samples a second time
        trained = [] if protocol_metrics(text) else (
            speculators.train_metrics(text) or trainers.dict_metrics(text)
            or trainers.step_metrics(text) or trainers.summary_metrics(text))
        for name, value in trained:
            self._sample(name, value, line, found)
        if trained:
            self._healthy()  # a trainer that reports its steps is alive
            if self.phase in ("starting", "loading"):
                self._set_phase("running")
        if line.source in self._bench:
            for name, value in bench.row(text):
                self._sample(name, value, line, found, self.blocks)
                if name in ("completed", "failed"):
                    self.requests = self.requests or [0.0, 0.0]
                    self.requests[name == "failed"] += value
        result = bench.result_line(text)
        if result is not None:
            for name, value in result[0]:
                self._sample(name, value, line, found)
            self._healthy()  # the tool measured: it is alive
            self._set_phase(result[1])
        mark = sglang.load_mark(text)
        if mark is not None:
            self._load_time(mark, line, found)
        if PROTOCOL in text:
            samples = protocol_metrics(text)
            for name, value in samples:
                self._sample(name, value, line, found)
            if samples:
                self._healthy()  # the job is alive and reporting

    def _load_time(self, mark: str, line: Line, found: list[Metric]) -> None:
        """A weight load's length from the times of its begin and end lines (SGLang before 0.5.23)."""
        if mark == "begin":
            self._load_begin = line.stamp
            return
        begin, end = stamp_seconds(self._load_begin), stamp_seconds(line.stamp)
        self._load_begin = None
        if begin is not None and end is not None:
            self._sample("load_weight_s", (end - begin) % 86400, line, found)

    def _sample(self, name: str, value: float, line: Line, found: list[Metric], repeat: int | None = None) -> None:
        self.metrics[name] = value
        found.append(Metric(name, value, self.lines, line.stamp, repeat))

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

    def _feed_traceback(self, line: Line) -> str | ExceptionEnd | Cut | None:
        event = self._tracebacks.feed(line.source, line.text, line.level in ("DEBUG", "WARNING"))
        if isinstance(event, Cut):
            self._cut(event, line)
            return None
        return event

    def _cut(self, cut: Cut, line: Line) -> None:
        """A traceback that stopped before its exception line: still an exception, its class unknown unless a
        frame's `raise` named it. Tentative: what follows decides."""
        if cut.quiet:
            return
        kind = exception_kind(cut.exception) if cut.exception else "python_exception"
        line_no = max(1, self.lines - 1) if line.raw else self.lines
        self._raise(LogError(kind, cut.exception, CUT_MESSAGE, line_no,
                             self._context(line.raw) if line.raw else list(self._recent), False,
                             source=cut.source), cut.chained, True)
        if self.error is not None and (self.error.line == line_no or cut.chained) and not self.error.fatal:
            # Its outermost frame shows something caught it, and the log went on: survived unless the log
            # says more, as a complete caught traceback is. One the log ends in is how the run ended (also
            # when the line that cut it is the log's last, itself cut: a partial line is no work going on).
            self._caught = cut.top is False and bool(line.raw) and not self._cut_line
            if self._caught and self._answered_during:
                self._healthy()  # a request was answered while it was written: the server went on
        self._answered_during = False

    def _find_error(self, line: Line) -> None:
        text = line.text
        event = self._feed_traceback(line)
        if event == "frame":
            return  # source lines quoted in a traceback are code, not messages
        if event == "chain":
            if self.error is None:
                self._orphan_root()
            return
        if isinstance(event, ExceptionEnd):
            self._answered_during = False
            if line.level in ("DEBUG", "WARNING"):
                return  # a traceback logged as a warning: something was tried and given up on
            self._exception(line, event.exception, event.message, event.chained, event.top is True,
                            caught=event.top is False)
            return
        quiet = line.level in _QUIET_LEVELS
        if quiet and _ANY_LEVEL.search(text):
            quiet = False  # a marker that counts at any level
        if quiet or HARMLESS.search(text):
            return
        if line.level in _LOUD_LEVELS and event is None:
            found = exception_line(text, bare=True)
            if found is not None:  # 'ValueError: ...' logged at ERROR level without a traceback
                self._exception(line, found[0], found[1], False, False)
                return
        if not _ANY_RULE.search(text):
            return
        rules = classify(text, _RULES)
        if rules is not None:
            kind, fatal, cause = rules
            exception = None
            message = text.strip()
            if event == "start":
                message = message.split(HEADER_START)[0].rstrip(" :")
            else:
                shown = exception_line(text, bare=True)
                if shown is not None:  # an exception line of a traceback cut before its header
                    exception, message = shown
                    kind = max(kind, exception_kind(exception), key=RANK.__getitem__)
            self._raise(LogError(kind, exception, message[:MESSAGE_CHARS], self.lines, self._context(line.raw),
                                 fatal, source=line.source), False, cause)

    def _exception(self, line: Line, exception: str, message: str, chained: bool, top: bool,
                   caught: bool = False) -> None:
        # An exception line the log ends in without its line end: the log was cut there, as inside a traceback.
        caught = caught and not self._cut_line
        err = self.error
        if err is not None and err.kind == "killed" and err.exception is None and vllm.DEAD.search(exception):
            entry = f"{exception}: {message}"[:CHAIN_CHARS]
            if entry not in err.chain and len(err.chain) < CHAIN_MAX:
                err.chain.append(entry)  # the engine core was killed: every user of it raises this after
            return
        kind = exception_kind(exception)
        fatal = top  # nothing caught it: the interpreter exits
        cause = True
        rules = classify(f"{exception}: {message}", _RULES)
        if rules is not None:
            kind = max(kind, rules[0], key=RANK.__getitem__)
            fatal = fatal or rules[1]
        before = self.error
        self._raise(LogError(kind, exception, message[:MESSAGE_CHARS], self.lines, self._context(line.raw), fatal,
                             source=line.source), chained, cause)
        # Whether it was caught is the last word of a chain: what the chain's last traceback shows.
        if self.error is not before and self.error is not None and (self.error.line == self.lines or chained):
            self._caught = caught and not fatal

    def _orphan_root(self) -> None:
        """'The above exception ...' whose traceback the log does not hold: its exception line may be there."""
        back = 0
        for raw in reversed(self._recent):
            back += 1
            text = clean(raw).text
            if not text.strip() or text[0] in " \t":
                continue  # blank, or the rest of a message that spans lines
            found = exception_line(text)  # the line just before the chain's words ends a traceback
            if found is not None:
                self._exception(Line(text, raw, "", None), found[0], found[1], False, False)
                if self.error is not None:
                    self.error.line = max(1, self.lines - back)
            return

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

    def _healthy(self) -> None:
        """Work goes on after a traceback: it did not kill the job."""
        if self.error is not None and not self.error.fatal:
            self.error = None
            self._error_after = 0
            self._error_progress = None
            self._caught = False

    def _set_phase(self, phase: str) -> None:
        if self.phase == "failed" or (self.phase == "finished" and phase != "failed"):
            return
        if phase != self.phase:
            self.phases_passed.append(phase)
        if phase == "failed":
            self._failed_in = self.phase
        self.phase = phase

    def _raise(self, new: LogError, chained: bool, cause: bool) -> None:
        if self._stopping:
            return  # a stop was asked for: what fails as the server shuts down is how it stopped
        cur = self.error
        phase = self._failed_in if self.phase == "failed" else self.phase
        # A tentative error long before is unrelated to a new cause; a bare 'Killed' still ends it.
        if cur is not None and not cur.fatal and new.line - cur.line > STALE_LINES and cause:
            cur = None
        if cur is None:
            err = new
        else:
            shown = classify(cur.message, _RULES) if cur.exception is None else None
            err = merge(cur, new, chained, cause, shown is None or shown[2], self._caught)
        if err != cur:
            if cur is None or err.line != cur.line:
                self._error_after = CONTEXT_AFTER
                self._caught = False  # a new root cause: whether it was caught is its own (set by callers)
            self.error = err
            last = self._last_bar()
            self._error_progress = [last.label, last.done] if last else None
            err.hint = hint_of(err, phase, self.cpu)
            self._more = MORE_LINES if _REASONS_FOLLOW.search(f"{err.exception}: {err.message}") else 0
        if err.fatal:
            self._set_phase("failed")

    def _context(self, raw: str) -> list[str]:
        return [*self._recent, raw[:CONTEXT_LINE_CHARS]]

    def _reason(self, line: Line) -> None:
        """A pydantic ValidationError says why on the lines after it (a field's name, then '  Value error,
        ...', then a link): the reasons join its message."""
        err = self.error
        if err is None or err.line == self.lines:
            return
        text = line.text.strip()
        indented = line.text[:1].isspace()
        if not text or not (indented or _FIELD.match(text)):
            self._more = 0  # the reasons are over
            return
        self._more -= 1
        if not text.startswith("For further information"):
            err.message = f"{err.message}: {text}"[:MESSAGE_CHARS]
            err.hint = hint_of(err, self._failed_in if self.phase == "failed" else self.phase, self.cpu)

    def _remember(self, raw: str) -> None:
        raw = raw[:CONTEXT_LINE_CHARS]
        if self._error_after > 0 and self.error is not None and self.error.line != self.lines:
            self.error.context.append(raw)
            self._error_after -= 1
        self._recent.append(raw)

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
