"""Raw log bytes to clean logical lines: line splitting, ANSI removal, per-process prefixes."""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

MAX_LINE_BYTES = 64 * 1024  # the rest of a longer line is dropped: a log line never needs more

_BREAK = re.compile(rb"\r\n?|\n")
# CSI (colours, cursor moves), OSC (titles, links) and the two-byte escapes.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
# vLLM worker prefix, e.g. '(Worker_TP0 pid=123) ' or Ray's '(Worker pid=1, ip=10.0.0.2) '.
_WORKER = re.compile(r"^\((?P<name>[\w.-]+) pid=\d+(?:, ip=[\w.:-]+)?\) ?")
# vLLM's logging prefix; its formatter repeats it on every line of a multi-line message.
_VLLM_LEVEL = re.compile(
    r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?"
)
# torchrun/TP workers prefix every line of their stderr with '[rank3]: '.
_RANK = re.compile(r"^\[rank(?P<rank>\d+)\]: ?")
# Levels of other formats: Python's '%(asctime)s - %(name)s - LEVEL - ', 'LEVEL:name:', uvicorn's 'INFO:  '.
_OTHER_LEVEL = re.compile(
    r"^(?:[^\s]+ [^\s]+ - [^\s]+ - (?P<a>[A-Z]+) - |(?P<b>DEBUG|INFO|WARNING|ERROR|CRITICAL):)"
)


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text) if "\x1b" in text else text


# For a terminal: whole escape sequences (CSI; OSC, DCS, SOS, PM and APC strings up to BEL, ST or the end
# of the line; two-byte escapes), then every control character left except tab, newline and '\r'
# (progress bars redraw with it). C1 controls (U+0080-U+009F) go too: some terminals act on them.
_TERMINAL_SEQ = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[\]PX^_][^\x07\x1b\n]*(?:\x07|\x1b\\)?|[ -/]*[0-~])")
_COMPLETE_SEQ = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[\]PX^_][^\x07\x1b\n]*[\x07\n]|(?![\[\]PX^_])[ -/]*[0-~])")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_HOLD_CHARS = 4096  # an escape sequence longer than this is cut (and so neutralised) where it is split


def terminal_safe(text: str) -> str:
    """Log text that a terminal shows without acting on it: no window title, clipboard write (OSC 52),
    screen clear or cursor move can pass; printable text, tabs, newlines and '\r' stay."""
    return _CONTROL.sub("", _TERMINAL_SEQ.sub("", text) if "\x1b" in text else text)


class TerminalText:
    """`terminal_safe` over log bytes that arrive in chunks: a UTF-8 character or an escape sequence split
    between two chunks is decoded and removed whole, not shown in halves."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""

    def feed(self, data: bytes, final: bool = False) -> str:
        text = self._held + self._decoder.decode(data, final)
        self._held = ""
        start = text.rfind("\x1b")
        if not final and start != -1 and len(text) - start < _HOLD_CHARS and not _COMPLETE_SEQ.match(text, start):
            text, self._held = text[:start], text[start:]
        return terminal_safe(text)


@dataclass(slots=True)
class Line:
    """One logical line, with what was peeled off its front."""

    text: str  # without ANSI codes, worker/level/rank prefixes
    raw: str  # without ANSI codes only
    source: str  # which process wrote it ('' when unknown): keeps interleaved tracebacks apart
    level: str | None  # logging level when the format shows one


def clean(decoded: str) -> Line:
    raw = strip_ansi(decoded)
    text = raw
    source = ""
    level: str | None = None
    if text.startswith("("):
        m = _WORKER.match(text)
        if m:
            source = m.group("name")
            text = text[m.end():]
    if text[:1] in ("D", "I", "W", "E", "C"):
        m = _VLLM_LEVEL.match(text)
        if m:
            level = m.group("level")
            text = text[m.end():]
    if text.startswith("[rank"):
        m = _RANK.match(text)
        if m:
            source += "/rank" + m.group("rank")
            text = text[m.end():]
    if level is None:
        m = _OTHER_LEVEL.match(text)
        if m:
            level = m.group("a") or m.group("b")
    return Line(text=text, raw=raw, source=source, level=level)


class LineSplitter:
    """Incremental splitter on '\\r', '\\n' and '\\r\\n': the same lines however the bytes are chunked."""

    def __init__(self) -> None:
        self.buf = b""
        self.pending_cr = False  # data ended in '\r': whether a '\n' follows is not known yet

    def feed(
        self, data: bytes, skip: Callable[[bytes, int, int], int] | None = None
    ) -> Iterator[tuple[bytes, bool]]:
        """Yield (line bytes, ended by a lone '\\r') for each line completed by `data`.

        `skip(data, start, end)` may consume whole lines itself from the start of a line: it returns where
        the lines it took end (`start` when it took none).
        """
        if not data:
            return
        if self.pending_cr:
            data = b"\r" + data
        self.pending_cr = data[-1:] == b"\r"
        end = len(data) - 1 if self.pending_cr else len(data)
        pos = 0
        while True:
            if skip is not None and not self.buf and pos < end:
                pos = skip(data, pos, end)
            m = _BREAK.search(data, pos, end)
            if m is None:
                break
            yield self._take(data[pos:m.start()]), m.group() == b"\r"
            pos = m.end()
        room = MAX_LINE_BYTES - len(self.buf)
        if room > 0 and pos < end:
            self.buf += data[pos:min(end, pos + room)]

    def finish(self) -> Iterator[tuple[bytes, bool]]:
        if self.buf or self.pending_cr:
            yield self._take(b""), self.pending_cr
        self.pending_cr = False

    def _take(self, tail: bytes) -> bytes:
        if not self.buf:
            return tail[:MAX_LINE_BYTES]
        line = self.buf + tail[:MAX_LINE_BYTES - len(self.buf)]
        self.buf = b""
        return line

    def to_dict(self) -> dict[str, Any]:
        # latin-1 maps every byte to one code point, so any partial line survives JSON unchanged.
        return {"buf": self.buf.decode("latin-1"), "pending_cr": self.pending_cr}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LineSplitter:
        s = cls()
        s.buf = d.get("buf", "").encode("latin-1")
        s.pending_cr = bool(d.get("pending_cr", False))
        return s
