"""Finding the error a log ends in: its exception or marker, kind and cause, whether something caught it,
its context and reasons; the part of LogParser that decides why a run failed."""

from __future__ import annotations

import re
from collections import deque

from . import sglang, slurm, speculators, vllm
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
from .formats import Screen
from .hints import hint_of
from .text import Line, clean
from .tqdm import Progress
from .traceback import HEADER_START, Cut, ExceptionEnd, TracebackTracker

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
_QUIET_LEVELS = {"DEBUG", "INFO", "WARNING"}
_LOUD_LEVELS = {"ERROR", "CRITICAL"}


class ErrorFinder:
    """LogParser's reading of errors. What it keeps of the parser's state is named here; the parser makes
    and stores it."""

    error: LogError | None
    phase: str
    lines: int
    cpu: bool
    _recent: deque[str]
    _tracebacks: TracebackTracker
    _error_after: int  # lines still to add after the error to its context
    _error_progress: list[object] | None  # [label, done] when the error was seen
    _caught: bool  # the error is a complete traceback that something caught
    _failed_in: str | None  # the phase the run failed in
    _stopping: bool  # a stop was asked for: what fails from here on is no cause
    _more: int  # lines after a pydantic ValidationError still to add to its message (its reasons)
    _answered_during: bool  # a request was answered while a traceback was being written
    _cut_line: bool  # reading the line the log ends in without its line end

    def _set_phase(self, phase: str) -> None:
        raise NotImplementedError  # the parser's

    def _last_bar(self) -> Progress | None:
        raise NotImplementedError  # the parser's

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

    def _group_stopped(self) -> None:
        """The API server was signalled: a stop of the whole process group, whose engine core may have gone
        a moment before it (the client's 'engine core exited unexpectedly' then): no kill, a stop. Once the
        core's death has failed the engine's users (EngineDeadError, in its chain), the kill came first and
        the signal after it (orch stopping what was left of a crashed server): the kill stands."""
        err = self.error
        if err is None or err.kind != "killed" or vllm.CORE_EXITED not in err.message or err.chain:
            return
        self.error, self._error_after, self._caught = None, 0, False
        if self.phase == "failed":
            self.phase, self._failed_in = self._failed_in or "running", None

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

    def _healthy(self) -> None:
        """Work goes on after a traceback: it did not kill the job."""
        if self.error is not None and not self.error.fatal:
            self.error = None
            self._error_after = 0
            self._error_progress = None
            self._caught = False

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
