"""Python tracebacks, followed line by line, one per writing process so interleaved ranks stay apart."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

HEADER = "Traceback (most recent call last):"
# The last line of a traceback: 'torch.OutOfMemoryError: CUDA out of memory. ...' or only 'TypeError'
# when the message is empty.
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?:: ?(?P<message>.*))?$")
_CHAIN = re.compile(
    r"^(?:During handling of the above exception, another exception occurred:"
    r"|The above exception was the direct cause of the following exception:)"
)
_MAX_SOURCES = 64  # bound on tracebacks followed at once


@dataclass
class ExceptionEnd:
    """A traceback reached its exception line."""

    exception: str
    message: str
    chained: bool  # raised while handling an earlier exception of the same process


class TracebackTracker:
    """Says for each line whether it opens, continues or ends a traceback."""

    def __init__(self) -> None:
        # source -> [mode, chained]; mode 'frames' inside a traceback, 'after' just past its last line.
        self.open: dict[str, list[Any]] = {}

    def feed(self, source: str, text: str) -> str | ExceptionEnd | None:
        """'start', 'frame', an ExceptionEnd, or None for a line outside any traceback."""
        state = self.open.get(source)
        if HEADER in text:
            chained = state is not None and state[0] == "after" and state[1]
            self._set(source, ["frames", chained])
            return "start"
        if state is None:
            return None
        if state[0] == "frames":
            if not text or text[0] in " \t":
                return "frame"
            m = _EXCEPTION.match(text.rstrip())
            if m:
                self.open[source] = ["after", False]
                return ExceptionEnd(m.group("type"), (m.group("message") or "").strip(), bool(state[1]))
            del self.open[source]  # something else interrupted it: not a traceback we can finish
            return None
        if not text.strip():
            return None
        if _CHAIN.match(text):
            state[1] = True
            return "frame"
        del self.open[source]
        return None

    def _set(self, source: str, state: list[Any]) -> None:
        self.open.pop(source, None)
        if len(self.open) >= _MAX_SOURCES:
            del self.open[next(iter(self.open))]
        self.open[source] = state

    def to_dict(self) -> dict[str, Any]:
        return {"open": [[k, v[0], v[1]] for k, v in self.open.items()]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TracebackTracker:
        t = cls()
        t.open = {k: [mode, chained] for k, mode, chained in d.get("open", [])}
        return t
