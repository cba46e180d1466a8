"""Python tracebacks, followed line by line, one per writing process so interleaved ranks stay apart."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import exception_line

HEADER = "Traceback (most recent call last):"
HEADER_START = "Traceback (most recent"  # what a pane that clips long lines still shows of it
_CHAIN = re.compile(
    r"^(?:During handling of the above exception, another exception occurred:"
    r"|The above exception was the direct cause of the following exception:)"
)
# The outermost frame of an exception nobody caught: a script's module level, or `python -m`'s runner.
# A multiprocessing child's own top level counts: the child exits with it.
_TOP_FRAME = re.compile(r', in <module>\s*$|, in _run_module_as_main\b|"<frozen runpy>"'
                        r'|multiprocessing/process\.py", line \d+, in _bootstrap\s*$')
# Frame lines that pasted or re-logged tracebacks may show without their indentation.
_FRAME_LINE = re.compile(r'^(?:File "|\[Previous line repeated|\.\.\.<\d+ lines>\.\.\.|[~^]+\s*$)')
_HEADLESS_FRAME = re.compile(r'^\s+File "[^"]+", line \d+, in ')
_MAX_SOURCES = 64  # bound on tracebacks followed at once
# The statement a frame quotes: the class a cut traceback was raising.
_RAISE = re.compile(r"^\s*raise ((?:[A-Za-z_]\w*\.)*[A-Z]\w*)\b")
CUT_GRACE = 5  # lines after a cut in which a stray exception line still ends the traceback


_FRAME_END = re.compile(r", in (?:<\w+>|\w+)\s*$")
_UNKNOWN = "?"  # the outermost frame arrived, clipped before it said where it was


def _outermost(frame: str) -> bool | str:
    """Whether the outermost frame is the top level, or _UNKNOWN when its line was clipped."""
    if _TOP_FRAME.search(frame):
        return True
    return False if _FRAME_END.search(frame) else _UNKNOWN


def _known(top: bool | str | None) -> bool | None:
    return None if top is None or top == _UNKNOWN else bool(top)


def _clipped_header(text: str) -> bool:
    """A header that a pane clipped ('... WorkerProc hit an exception. Traceback', 'Traceback (most rec')."""
    i = text.rfind("Traceback")
    return (i == 0 or text[i - 1] in " :") and HEADER.startswith(text[i:].rstrip())


@dataclass
class ExceptionEnd:
    """A traceback reached its exception line."""

    exception: str
    message: str
    chained: bool  # raised while handling an earlier exception of the same process
    top: bool | None  # its outermost frame is the top level: nothing caught it, the interpreter exits
    # (None: where it was is not known, the frame line was clipped before its function's name)


@dataclass
class Cut:
    """A traceback stopped before its exception line: the log was cut, or another line interrupted it."""

    exception: str | None  # the class a frame's `raise` statement names, when one does
    quiet: bool  # its header was logged at DEBUG or WARNING: something was tried and given up on
    top: bool | None = None  # its outermost frame is the top level (None: no frame arrived)
    chained: bool = False  # raised while handling an earlier exception of the same process
    source: str = ""  # the process that wrote it


class TracebackTracker:
    """Says for each line whether it opens, continues or ends a traceback."""

    def __init__(self) -> None:
        # source -> [mode, chained, top, after_file, raised, quiet, grace]; mode 'frames' inside a traceback,
        # 'after' just past its exception line, 'cut' after a traceback was interrupted; after_file: the
        # line before was a 'File ...' line, so this one is its source; raised: the class a quoted `raise`
        # names; quiet: the header was logged at DEBUG/WARNING; grace: lines left in 'cut' mode.
        self.open: dict[str, list[Any]] = {}

    def feed(self, source: str, text: str, quiet: bool = False) -> str | ExceptionEnd | Cut | None:
        """'start', 'frame', 'chain', an ExceptionEnd, a Cut (the line interrupted a traceback, and is read
        as it is), or None for a line outside any traceback."""
        state = self.open.get(source)
        if HEADER_START in text or ("Traceback" in text and _clipped_header(text)):
            chained = state is not None and state[0] == "after" and state[1]
            self._set(source, ["frames", chained, None, False, None, quiet, 0])
            return "start"
        if state is None:
            if _CHAIN.match(text):  # the traceback before it was not in the log (cut, or never printed)
                self._set(source, ["after", True, None, False, None, False, CUT_GRACE])
                return "chain"
            if text[:1] in (" ", "\t") and _HEADLESS_FRAME.match(text):
                # A log that begins inside a traceback: its exception line still ends it. Where its
                # outermost frame was is not known.
                self._set(source, ["frames", False, False, True, None, quiet, 0])
                return "frame"
            return None
        if state[0] == "cut":
            found = exception_line(text, bare=True)
            if found:  # the exception line after a clipped or elided stretch, or another writer's lines
                self.open[source] = ["after", False, None, False, None, False, 0]
                return ExceptionEnd(found[0], found[1], bool(state[1]), _known(state[2]))
            if text.lstrip().startswith('File "'):
                # The frames go on: what interrupted them was another writer's line.
                state[0], state[3] = "frames", True
                if state[2] is None:
                    state[2] = _outermost(text)
                return "frame"
            state[6] -= 1
            if state[6] <= 0:
                del self.open[source]
            return None
        if state[0] == "frames":
            after_file, state[3] = state[3], False
            if text.lstrip().startswith('File "'):
                if state[2] is None:
                    state[2] = _outermost(text)
                state[3] = True
                return "frame"
            if not text or text[0] in " \t" or _FRAME_LINE.match(text):
                if after_file and "raise" in text:
                    m = _RAISE.match(text)
                    if m:
                        state[4] = m.group(1)
                return "frame"
            found = exception_line(text)
            if found:
                self.open[source] = ["after", False, None, False, None, False, 0]
                return ExceptionEnd(found[0], found[1], bool(state[1]), _known(state[2]))
            if after_file:
                return "frame"  # a source line that lost its indentation
            # Something else interrupted it: the traceback was cut short, or another writer's line came
            # between its lines (then its frames or its exception line still follow).
            self.open[source] = ["cut", state[1], state[2], False, state[4], state[5], CUT_GRACE]
            return Cut(state[4], bool(state[5]), _known(state[2]), bool(state[1]), source)
        if not text.strip():
            return None
        if _CHAIN.match(text):
            state[1], state[6] = True, CUT_GRACE
            return "chain"
        if state[1] and state[6] > 0:
            state[6] -= 1  # another writer's line between 'The above exception ...' and the next traceback
            return None
        del self.open[source]
        return None

    def cut_at_end(self) -> list[Cut]:
        """The tracebacks the log ends inside of."""
        cuts = [Cut(state[4], bool(state[5]), _known(state[2]), bool(state[1]), source)
                for source, state in self.open.items() if state[0] == "frames"]
        self.open.clear()
        return cuts

    def _set(self, source: str, state: list[Any]) -> None:
        self.open.pop(source, None)
        if len(self.open) >= _MAX_SOURCES:
            del self.open[next(iter(self.open))]
        self.open[source] = state

    def to_dict(self) -> dict[str, Any]:
        return {"open": [[k, *v] for k, v in self.open.items()]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TracebackTracker:
        t = cls()
        t.open = {k: (list(rest) + [None, False, None, False, 0])[:7] for k, *rest in d.get("open", [])}
        return t
