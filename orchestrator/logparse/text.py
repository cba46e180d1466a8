"""Raw log bytes to clean logical lines: line splitting, ANSI removal, per-process prefixes."""

from __future__ import annotations

import calendar
import codecs
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

MAX_LINE_BYTES = 64 * 1024  # the rest of a longer line is dropped: a log line never needs more

_BREAK = re.compile(rb"\r\n?|\n")
# CSI (colours, cursor moves), OSC (titles, links) and the two-byte escapes.
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
# Prefixes are recognised by their shape, not by the program that writes them: whatever launcher, collector
# or logger put them there, a line's own text starts where they end.
_LEVELS = r"DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL"
_LEVEL_NAME = {"WARN": "WARNING", "FATAL": "CRITICAL"}
_ZONE = r"(?:Z|[+-]\d\d:?\d\d| ?UTC)?"
# A process tag in parentheses: a name, then key=value pairs, one of them a pid or a rank: vLLM's
# '(Worker_TP0 pid=123) ', '(EngineCore_DP0 pid=9) ', '(VllmWorker rank=0 pid=5) ', Ray's
# '(RayWorkerWrapper pid=1, ip=10.0.0.2) '. The name (and rank) keep interleaved tracebacks apart.
_WORKER = re.compile(r"^\((?:(?P<name>[\w.-]+)(?P<rank> rank=\d+)?,? )?(?:pid|rank)=\d+(?:,? ?\w+=[\w.:/-]+)*\) ?")
_VLLM_PROCESS = re.compile(r"APIServer|EngineCore|Worker_|VllmWorker|RayWorker")
# vLLM's logging prefix, 0.11+ '[file.py:12]' and 0.6 'file.py:12]'; repeated on every line of a record.
_VLLM_LEVEL = re.compile(
    r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<stamp>\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?"
    r" \[?[\w.<>-]+:\d+\] ?"
)
# A writer's tag in brackets, ended by ':': torchrun's '[rank3]: ', '[default0]:' and '[3]:' (its
# log_line_prefix_template), mpirun's '[1,0]<stdout>:', any '[worker-2]: '.
_RANK = re.compile(r"^\[(?:(?P<rank>(?:[A-Za-z_]{1,16}[_-]?)?\d{1,6})\]|(?P<mpi>\d+,\d+)\]<std(?:out|err)>)"
                   r":(?: |(?=\S)|$)")
# c10d's own prefix: '[E626 06:24:44.903881913 ProcessGroupNCCL.cpp:616] '.
_C10D = re.compile(r"^\[(?P<level>[IWEF])\d{3,4} \d\d:\d\d:\d\d\.\d+ [^\]]{0,200}\] ")
_C10D_LEVELS = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
# SGLang: '[2026-01-02 10:00:00 DP0 TP3] ', also '[2026-01-02 10:00:00.123] ' and the old '[10:00:00 TP0] '.
_SGLANG = re.compile(
    r"^\[(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d|\d\d:\d\d:\d\d)(?:[.,]\d+)?(?P<tags>(?: [A-Z]{2}\d+)*)\] ")
# Any other bracketed column made of what prefixes hold: times, dates, levels, rank or process tags, source
# locations, kubectl's '[pod/name/container]'. '[2025-01-01T10:00:00Z] ', '[INFO] ', '[Rank 0] ',
# '[logging.py:96:log_dist] ', DeepSpeed's and Accelerate's columns.
_TOKEN = (r"(?:(?P<date>\d{4}-\d\d-\d\d)[ T](?P<time>\d\d:\d\d:\d\d)(?:[.,]\d+)?" + _ZONE
          + r"|\d\d/\d\d/\d\d(?:\d\d)?|\d\d:\d\d:\d\d(?:[.,]\d+)?" + _ZONE
          + r"|\d{4}-\d\d-\d\d|(?P<level>" + _LEVELS + r")|[A-Za-z_]{1,16}[ _-]?\d{1,6}"
          + r"|[\w.<>-]+\.\w{1,4}:\d+(?::[\w<>.]+)?|(?:pod|deployment|job|statefulset)/[\w.-]+(?:/[\w.-]+)?)")
_COLUMN = re.compile(r"^\[" + _TOKEN + r"(?:[ ,|]+(?:" + _TOKEN.replace("?P<", "?P<_") + r"))*\]:? ?")
# Python logging: '2025-10-01 12:00:00,000 - name - LEVEL - ' (speculators <0.5, wrappers), '... - LEVEL - '.
_PYLOG = re.compile(
    r"^(?P<stamp>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:[.,]\d+)?(?:[+-]\d\d:?\d\d)?(?: - [^\s]+)? - "
    r"(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) - "
)
# A time in front, with a level after it or not: docker's and kubectl's RFC 3339 time, '2025-01-01 10:00:00,123
# INFO ', loguru's '2025-01-01 10:00:00.123 | INFO     | '.
_STAMP = re.compile(
    r"^(?P<stamp>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:[.,]\d+)?" + _ZONE + r"(?: \| ?| )"
    # (one space only: the line's own indentation stays; a vLLM layout after it is peeled on its own)
    r"(?:\[?(?P<level>" + _LEVELS + r")\]?(?! \d\d-\d\d \d\d:)(?: *[|:] *| - | +))?"
)
# What a collector or launcher puts in front: journald's 'Mon DD HH:MM:SS host unit[pid]: ', docker
# compose's 'service-1  | ' (the name padded to the longest), `srun --label`'s task number ' 3: '.
_OUTER = re.compile(
    r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d [\w.-]+ [\w.@/-]+(?:\[\d+\])?: "
    r"|[\w.-]+(?:[-_]\d+ +| {2,})\| )"
)
_TASK = re.compile(r"^ {0,3}(?P<task>\d{1,5}): ")
# Levels that only tag a line: 'LEVEL:name:' (logging's default), uvicorn's 'INFO:     '.
_OTHER_LEVEL = re.compile(r"^(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL):")


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

    text: str  # without ANSI codes and the prefixes of processes, loggers and collectors
    raw: str  # without ANSI codes only
    source: str  # which process wrote it ('' when unknown): keeps interleaved tracebacks apart
    level: str | None  # logging level when the format shows one (the innermost, where prefixes nest)
    stamp: str | None = None  # the line's own time as printed ('2026-01-02 10:00:00', '03-01 11:02:00')
    layout: str | None = None  # 'vllm' or 'sglang' when a prefix only that engine writes was peeled
    body: str = ""  # without what a launcher or collector put in front: what the program itself wrote


def clean(decoded: str) -> Line:
    raw = strip_ansi(decoded)
    line = Line(text=raw, raw=raw, source="", level=None)
    # Prefixes nest (a collector's time, a task number, a process name, then a logger's level): peel until
    # none is left, those that launchers and collectors add first.
    for carrier in (True, False):
        for _ in range(8):
            if not _peel(line, carrier):
                break
        if carrier:
            line.body = line.text
    return line


def _level(name: str) -> str:
    return _LEVEL_NAME.get(name, name)


def _peel(line: Line, carrier: bool = False) -> bool:
    """Take one prefix off the front of line.text; False when there is none. `carrier`: only those that a
    launcher or collector adds (process, rank and task tags, a collector's time), not a logger's columns."""
    text = line.text
    first = text[:1]
    m: re.Match[str] | None
    if first == "(":
        m = _WORKER.match(text)
        if m:
            name = m.group("name") or ""
            line.source += name + (m.group("rank") or "")
            if _VLLM_PROCESS.match(name):
                line.layout = "vllm"
            line.text = text[m.end():]
            return True
        return False
    if first == "[":
        m = _RANK.match(text)
        if m:
            line.source += "/" + (m.group("rank") or m.group("mpi"))
            line.text = text[m.end():]
            return True
        m = _SGLANG.match(text)
        if m and (m.group("tags") or not carrier):  # a rank's tag is a process's, as vLLM's worker names are
            line.stamp = m.group("stamp")
            if m.group("tags"):  # only SGLang tags its lines with the ranks
                line.layout = "sglang"
            line.text = text[m.end():]
            return True
        if carrier:
            return False
        m = _C10D.match(text)
        if m:
            line.level = _C10D_LEVELS[m.group("level")]
            line.text = text[m.end():]
            return True
        m = _COLUMN.match(text)
        if m:
            if m.group("date"):
                line.stamp = f"{m.group('date')} {m.group('time')}"
            if m.group("level"):
                line.level = _level(m.group("level"))
            line.text = text[m.end():]
            return True
        return False
    if first in ("D", "I", "W", "E", "C") and not carrier:
        m = _VLLM_LEVEL.match(text)
        if m:
            line.level = m.group("level")
            line.stamp = m.group("stamp")
            line.layout = "vllm"
            line.text = text[m.end():]
            return True
        m = _OTHER_LEVEL.match(text)
        if m:
            line.level = m.group("level")  # the text stays: uvicorn's lines are read whole
            return False
    if first.isdigit():
        m = _PYLOG.match(text) or _STAMP.match(text)
        # A collector's time is RFC 3339's ('2025-01-01T10:00:00.123Z '); a logger's has its columns after it.
        if m and not (carrier and (m.re is _PYLOG or m.group("level") or text[10] != "T")):
            if m.group("level"):
                line.level = _level(m.group("level"))
            line.stamp = m.group("stamp").replace("T", " ")
            line.text = text[m.end():]
            return True
    if first.isdigit() or first == " ":
        m = _TASK.match(text)
        if m:
            line.source += "/task" + m.group("task")
            line.text = text[m.end():]
            return True
    if first.isalnum():
        m = _OUTER.match(text)
        if m:
            line.text = text[m.end():]
            return True
    return False


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


# Rich's log handler (speculators >= 0.5): an optional '[time] ' column (blank when the time repeats), the
# level padded to 8, the message, and the 'file.py:NN' column flush right on the first line of a record.
_RICH_FIRST = re.compile(
    r"^(?P<lead>\[[^\]]{6,30}\] | {10,30})?(?P<level>DEBUG    |INFO     |WARNING  |ERROR    |CRITICAL )"
    r"(?P<msg>\S.*?)? +(?P<path>[\w.<>-]+:\d+)$"
)
# What always starts a line of its own, however long the line before it: the parts of a traceback.
_RICH_NEW_LINE = re.compile(
    r"^(?:Traceback \(|File \"|The above exception|During handling"
    r"|(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b)"
)


RICH_FOREIGN = 3  # other writers' lines a Rich record may be interleaved with


class RichUnwrapper:
    """Joins the message lines Rich wrapped at the console width back into the lines the program logged.

    Every line of a record after the first is indented to the message column. Rich breaks a line only
    where the next word would not fit, so a continuation whose first word would have fitted on the line
    before it starts a new line of the message (a traceback line, say); one that would not is a wrap.
    """

    def __init__(self) -> None:
        self.col = 0  # where the message column starts
        self.width = 0  # how wide it is
        self.level = ""
        self.piece: str | None = None  # the message line being joined; None outside a Rich record
        self.last = 0  # length of its last physical part
        self.raw: list[str] = []  # its physical lines
        self.foreign = 0  # other writers' lines since the record's last line

    def feed(self, raw: str) -> tuple[list[tuple[str, str, str, int]], bool]:
        """(message lines completed by this physical line: text, raw, level, physical lines; whether the
        line is no part of a Rich record and is to be read as it is)."""
        done: list[tuple[str, str, str, int]] = []
        if self.piece is not None:
            part = self._continuation(raw)
            if part is None and self.foreign < RICH_FOREIGN and not self._first(raw):
                # Another writer's line between two of the record's: read it now, the record may go on.
                self.foreign += 1
                return done, True
            self.foreign = 0
            if part is not None:
                if self._wraps(part):
                    glue = "" if self.last >= self.width and " " not in self.raw[-1].strip() else " "
                    self.piece += glue + part
                    self.raw.append(raw)
                else:
                    done.append(self._take())
                    self.piece, self.raw = part, [raw]
                self.last = len(part)
                return done, False
            done.append(self._take())
            self.piece = None
        m = self._first(raw)
        if m is None:
            return done, True
        lead = m.group("lead") or ""
        self.col = len(lead) + 9
        self.width = len(raw) - self.col - len(m.group("path")) - 1
        self.level = m.group("level").strip()
        self.piece = (m.group("msg") or "").rstrip()
        self.last = len(self.piece)
        self.raw = [raw]
        return done, False

    @staticmethod
    def _first(raw: str) -> re.Match[str] | None:
        """The first line of a record, which ends in its 'file.py:NN' column."""
        if not raw[-1:].isdigit() or len(raw) < 40:
            return None
        return _RICH_FIRST.match(raw)

    def flush(self) -> list[tuple[str, str, str, int]]:
        if self.piece is None:
            return []
        done = [self._take()]
        self.piece = None
        return done

    def _continuation(self, raw: str) -> str | None:
        if len(raw) <= self.col:
            return "" if not raw.strip() else None
        if not raw.startswith(" " * self.col):
            return None
        return raw[self.col:].rstrip()

    def _wraps(self, part: str) -> bool:
        if not part or part[0] == " " or not self.piece or _RICH_NEW_LINE.match(part):
            return False
        return self.last + 1 + len(part.split(" ", 1)[0]) > self.width

    def _take(self) -> tuple[str, str, str, int]:
        assert self.piece is not None
        return self.piece, "\n".join(self.raw), self.level, len(self.raw)

    def to_dict(self) -> dict[str, Any]:
        return {"col": self.col, "width": self.width, "level": self.level, "piece": self.piece,
                "last": self.last, "raw": list(self.raw), "foreign": self.foreign}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RichUnwrapper:
        r = cls()
        r.col, r.width, r.level = int(d.get("col", 0)), int(d.get("width", 0)), d.get("level", "")
        r.piece, r.last, r.raw = d.get("piece"), int(d.get("last", 0)), list(d.get("raw", []))
        r.foreign = int(d.get("foreign", 0))
        return r


_YEARLESS = re.compile(r"^\d\d-\d\d \d\d:\d\d:\d\d$")
_FULL = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$")


def stamp_time(stamp: str | None, ref: float) -> float | None:
    """Epoch seconds of a line's own time (read as local time), or None when there is none.

    vLLM prints no year: the year is the one that puts the time nearest before `ref` (the time it was read).
    """
    if not stamp:
        return None
    try:
        if _FULL.match(stamp):
            return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
        if _YEARLESS.match(stamp):
            year = time.localtime(ref).tm_year
            for y in (year, year - 1):
                t = time.mktime(time.strptime(f"{y}-{stamp}", "%Y-%m-%d %H:%M:%S"))
                if t <= ref + 86400:
                    return t
    except (ValueError, OverflowError):
        return None
    return None


def stamp_seconds(stamp: str | None) -> float | None:
    """A line's own time in seconds, to subtract two of them: since the epoch (UTC) for a full date, since
    midnight for a time alone (callers take the difference modulo a day)."""
    if not stamp:
        return None
    try:
        if _FULL.match(stamp):
            return calendar.timegm(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
        if _YEARLESS.match(stamp):
            return calendar.timegm(time.strptime(f"2000-{stamp}", "%Y-%m-%d %H:%M:%S"))
        h, m, sec = (int(x) for x in stamp.split(":"))
        return float(h * 3600 + m * 60 + sec)
    except (ValueError, OverflowError):
        return None


def last_line(data: bytes, width: int = 200) -> str | None:
    """The last non-blank line of new log bytes (a progress bar's latest state included), printable."""
    for line in reversed(re.split(rb"\r\n?|\n", data[-8192:])):
        text = terminal_safe(line.decode(errors="replace")).strip()
        if text:
            return text[:width]
    return None
