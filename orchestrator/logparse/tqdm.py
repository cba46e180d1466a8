"""tqdm progress bars as tqdm's format_meter prints them (default, ncols=0, SGLang's layout, no total)."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

_SI = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18, "Z": 1e21, "Y": 1e24}

# Units seen behind an SI prefix ('kit/s', 'MB/s'); other words starting with 'k' or 'M' are left alone.
_SCALED_UNITS = {"it", "B", "iB", "tok", "token", "tokens", "sample", "samples", "req", "file", "files"}

_NUM = r"\d+(?:\.\d+)?[kMGTPEZY]?"
_TIME = r"(?:\d+:)?\d+:\d\d"
# ' 2.14it/s', '?it/s', '1.20kit/s', '3.00samples/s' or the inverse '18.01s/it'.
_RATE = rf"\s*(?:(?P<rate>\?|{_NUM})(?P<unit>[^\s,\]/]*)/s|(?P<inv>{_NUM})s/[^\s,\]]+)"

# '{pct:3.0f}%' then '|bar|' (default), ' Completed | ' (SGLang) or ' ' (ncols=0); then the right part.
# A pasted bar may have lost its closing '|' to an elision ('|████ ...... 3/4'). Bar and postfix are
# bounded so a long line full of near-bars costs linear time.
_WITH_TOTAL = re.compile(
    rf"(?<![\d.])(?P<pct>\d{{1,3}})%(?:\|[^|]{{0,1000}}\||\s+Completed\s*\||\|[^|\[\]0-9]{{0,1000}})?\s*"
    rf"(?P<n>{_NUM})/(?P<total>{_NUM}|\?)\s+"
    rf"\[(?P<elapsed>{_TIME})<(?P<remaining>{_TIME}|\?)(?:,{_RATE}|(?=[,\]]))(?P<postfix>[^\]]{{0,1000}})\]"
)  # a custom bar_format may leave the rate out (NeMo's: '[02:01<48:24, reduced_train_loss=6.120]')
# '123it [00:01, 99.50it/s]': no total, so no bar, no percentage and no ETA.
_NO_TOTAL = re.compile(
    rf"(?<![\w.])(?P<n>{_NUM})(?P<nunit>[^\s\d\[][^\s\[]*)? "
    rf"\[(?P<elapsed>{_TIME}),{_RATE}(?P<postfix>[^\]]{{0,1000}})\]"
)


@dataclass
class Progress:
    label: str
    done: float
    total: float | None
    percent: float | None
    elapsed_s: float | None
    eta_s: float | None
    rate_per_s: float | None  # items per second, also when tqdm printed seconds per item

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Progress:
        return cls(**d)


def parse_number(text: str) -> float:
    """'12', '1.20k', '3.4M' -> float (tqdm's unit_scale suffixes)."""
    if text[-1:] in _SI:
        return float(text[:-1]) * _SI[text[-1]]
    return float(text)


def parse_interval(text: str) -> float | None:
    """'MM:SS' or 'H:MM:SS' -> seconds; '?' -> None."""
    if text == "?":
        return None
    seconds = 0.0
    for part in text.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds


def _rate(m: re.Match[str]) -> float | None:
    if m.group("inv"):
        inv = parse_number(m.group("inv"))
        return 1.0 / inv if inv else None
    rate = m.group("rate")
    if rate is None or rate == "?":
        return None
    value = parse_number(rate)
    unit = m.group("unit") or ""
    # With unit_scale tqdm writes '1.20kit/s': the SI prefix sticks to the unit.
    if len(unit) > 1 and unit[0] in _SI and unit[1:] in _SCALED_UNITS:
        value *= _SI[unit[0]]
    return value


def _label(prefix: str) -> str:
    return prefix.strip().rstrip(": ")  # NeMo's desc ends in ': ' before tqdm's own ': 


def _from_match(m: re.Match[str], label: str) -> Progress:
    done = parse_number(m.group("n"))
    if m.re is _NO_TOTAL or m.re is _NO_TOTAL_ONLY:
        return Progress(label, done, None, None, parse_interval(m.group("elapsed")), None, _rate(m))
    total = None if m.group("total") == "?" else parse_number(m.group("total"))
    percent = done / total * 100 if total else float(m.group("pct"))
    return Progress(
        label=label,
        done=done,
        total=total,
        percent=round(percent, 4),
        elapsed_s=parse_interval(m.group("elapsed")),
        eta_s=parse_interval(m.group("remaining")),
        rate_per_s=_rate(m),
    )


def search_bar(text: str) -> re.Match[str] | None:
    """The first tqdm bar in `text`; everything in front of it is its label."""
    if "[" not in text:
        return None
    m = _WITH_TOTAL.search(text) if "%" in text else None
    return m or _NO_TOTAL.search(text)


# The same layouts, anchored at both ends: a line that is only a redraw, checked without slicing it.
_WITH_TOTAL_ONLY = re.compile(_WITH_TOTAL.pattern + r"\s*\Z")
_NO_TOTAL_ONLY = re.compile(_NO_TOTAL.pattern + r"\s*\Z")


def has_total(m: re.Match[str]) -> bool:
    return m.re is _WITH_TOTAL or m.re is _WITH_TOTAL_ONLY


def match_bar_at(text: str, pos: int, with_total: bool) -> re.Match[str] | None:
    """A bar of the given layout from `pos` to the end: the cheap check for a redraw of the last bar."""
    return (_WITH_TOTAL_ONLY if with_total else _NO_TOTAL_ONLY).match(text, pos)


def progress_of(m: re.Match[str]) -> Progress:
    return _from_match(m, _label(m.string[:m.start()]))


def parse_bar(text: str) -> Progress | None:
    m = search_bar(text)
    return progress_of(m) if m else None


# Byte-level redraw runs. Each byte pattern accepts a strict subset of what the text patterns above accept
# (ASCII digits and spaces, tqdm's block characters), so a run it takes is parsed line by line the same way.
_B_NUM = rb"[0-9]+(?:\.[0-9]+)?[kMGTPEZY]?"
_B_TIME = rb"[0-9]+:[0-9][0-9](?::[0-9][0-9])?"  # 'MM:SS' or 'H:MM:SS', without the text pattern's backtracking
_B_RATE = rb"[ ]*(?:(?:\?|" + _B_NUM + rb")[A-Za-z]*/s|" + _B_NUM + rb"s/[A-Za-z]+)"
# ' ', ascii '#'/digits and the bytes of U+2588..U+258F, as one class: a repeated group costs a lot more
# per byte. Any mix of those bytes decodes to at most as many characters, none of them '|'.
_B_CELLS = rb"[ #0-9\xe2\x96\x88-\x8f]{0,1000}"
_B_WITH_TOTAL = (
    rb"[0-9]{1,3}%(?:\|" + _B_CELLS + rb"\||[ ]+Completed[ ]*\|)?[ ]*"
    + _B_NUM + rb"/(?:" + _B_NUM + rb"|\?)[ ]+\[" + _B_TIME + rb"<(?:" + _B_TIME + rb"|\?),"
    + _B_RATE + rb"[\x20-\x5c\x5e-\x7e]{0,1000}\][ ]*"
)
_B_NO_TOTAL = (
    _B_NUM + rb"(?:[A-Za-z]+)? \[" + _B_TIME + rb"," + _B_RATE
    + rb"[\x20-\x24\x26-\x5c\x5e-\x7e]{0,1000}\][ ]*"  # no '%': those lines take the other layout
)


def redraw_run(prefix: str, with_total: bool) -> re.Pattern[bytes]:
    """One or more whole lines, each ended by a lone '\\r', that redraw the bar labelled by `prefix`."""
    body = _B_WITH_TOTAL if with_total else _B_NO_TOTAL
    return re.compile(rb"(?>" + re.escape(prefix.encode()) + body + rb"\r(?!\n))++")


# Digits read as '0': the byte patterns above treat every digit alike, so a line and its shape match alike.
SHAPE = bytes.maketrans(b"123456789", b"000000000")


def redraw_line(prefix: str, with_total: bool) -> re.Pattern[bytes]:
    """One whole line (without its '\\r') that redraws the bar labelled by `prefix`; use on shapes only when
    the prefix has no digits."""
    body = _B_WITH_TOTAL if with_total else _B_NO_TOTAL
    return re.compile(re.escape(prefix.encode()) + body)


def run_by_shapes(data: bytes, start: int, end: int, line: re.Pattern[bytes]) -> tuple[int, int] | None:
    """(end, lines) of the run of redraws from `start` to the next '\\n', when every line in it is one
    (`line`: redraw_line's pattern for the bar).

    The same run redraw_run matches, found faster: a stretch of redraws differs mostly in its digits, so
    with digits read as '0' it holds a handful of distinct lines, and only those are matched. None when
    one of them is no redraw: the regular expression then finds where the run stops.
    """
    nl = data.find(b"\n", start, end)
    region = data[start:end if nl < 0 else nl].translate(SHAPE)
    stop = region.rfind(b"\r") + 1
    unit = region[:region.find(b"\r") + 1]
    if unit and not (nl >= 0 and region.endswith(b"\r")):
        # Most often every line has one shape: k copies of it that tile the run are found by count().
        k, rest = divmod(stop, len(unit))
        if not rest and region.count(unit, 0, stop) == k:
            return (start + stop, k) if line.fullmatch(unit, 0, len(unit) - 1) else None
    shapes = region.split(b"\r")
    del shapes[-1]  # the part after the last '\\r': not ended by one, or ended by '\\n'
    if nl >= 0 and region.endswith(b"\r") and shapes:  # '\\r\\n' ends a line, not a redraw
        stop -= len(shapes.pop()) + 1
    if not shapes:
        return None
    if all(line.fullmatch(shape) for shape in set(shapes)):
        return start + stop, len(shapes)
    return None


SMOOTHING = 0.3  # tqdm's own: the weight of the newest interval


def paced(bar: dict[str, Any], before: dict[str, Any] | None, before_at: float | None, now: float) -> dict[str, Any]:
    """A bar that prints no rate (`orch-progress`, a Keras bar) with one and an ETA from when it was seen to
    move: `before` is the bar recorded at `before_at`. As tqdm does, the steps and the seconds between moves
    are each smoothed and the rate is their ratio (`smoothed`: the two, kept with the bar), so a move seen late
    and the next seen early do not swing it. A bar that prints its rate is left as it is."""
    if bar.get("rate_per_s") is not None or before is None or before.get("label") != bar.get("label"):
        return bar
    step = bar["done"] - before["done"]
    if step == 0:  # not moved since: the rate and ETA as they were when it last moved
        return {**bar, **{k: before.get(k) for k in ("rate_per_s", "eta_s", "smoothed")}}
    if step < 0 or before_at is None or now <= before_at:
        return bar  # started again: no rate until it moves twice
    steps, seconds = step, now - before_at
    if before.get("smoothed"):
        steps = SMOOTHING * steps + (1 - SMOOTHING) * before["smoothed"][0]
        seconds = SMOOTHING * seconds + (1 - SMOOTHING) * before["smoothed"][1]
    rate = steps / seconds
    total = bar.get("total")
    eta = max(total - bar["done"], 0) / rate if total else None
    return {**bar, "rate_per_s": round(rate, 6), "eta_s": None if eta is None else round(eta, 3),
            "smoothed": [steps, seconds]}
