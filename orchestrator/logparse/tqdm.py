"""tqdm progress bars as printed by tqdm's format_meter (default, ncols=0, SGLang's '% Completed |', no total)."""

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
_WITH_TOTAL = re.compile(
    rf"(?<![\d.])(?P<pct>\d{{1,3}})%(?:\|[^|]*\||\s+Completed\s*\|)?\s*"
    rf"(?P<n>{_NUM})/(?P<total>{_NUM}|\?)\s+"
    rf"\[(?P<elapsed>{_TIME})<(?P<remaining>{_TIME}|\?),{_RATE}(?P<postfix>[^\]]*)\]"
)
# '123it [00:01, 99.50it/s]': no total, so no bar, no percentage and no ETA.
_NO_TOTAL = re.compile(
    rf"(?<![\w.])(?P<n>{_NUM})(?P<nunit>[^\s\d\[][^\s\[]*)? \[(?P<elapsed>{_TIME}),{_RATE}(?P<postfix>[^\]]*)\]"
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
    def from_dict(cls, d: dict[str, Any]) -> "Progress":
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
    if rate == "?":
        return None
    value = parse_number(rate)
    unit = m.group("unit") or ""
    # With unit_scale tqdm writes '1.20kit/s': the SI prefix sticks to the unit.
    if len(unit) > 1 and unit[0] in _SI and unit[1:] in _SCALED_UNITS:
        value *= _SI[unit[0]]
    return value


def _label(prefix: str) -> str:
    label = prefix.strip()
    return label[:-1].rstrip() if label.endswith(":") else label


def find_bar(text: str) -> tuple[Progress, int, int] | None:
    """The first tqdm bar in `text` with its span, the label being everything in front of it."""
    if "[" not in text:
        return None
    m = _WITH_TOTAL.search(text) if "%" in text else None
    if m:
        done = parse_number(m.group("n"))
        total = None if m.group("total") == "?" else parse_number(m.group("total"))
        percent = done / total * 100 if total else float(m.group("pct"))
        return (
            Progress(
                label=_label(text[:m.start()]),
                done=done,
                total=total,
                percent=round(percent, 4),
                elapsed_s=parse_interval(m.group("elapsed")),
                eta_s=parse_interval(m.group("remaining")),
                rate_per_s=_rate(m),
            ),
            m.start(),
            m.end(),
        )
    m = _NO_TOTAL.search(text)
    if m:
        return (
            Progress(
                label=_label(text[:m.start()]),
                done=parse_number(m.group("n")),
                total=None,
                percent=None,
                elapsed_s=parse_interval(m.group("elapsed")),
                eta_s=None,
                rate_per_s=_rate(m),
            ),
            m.start(),
            m.end(),
        )
    return None


def parse_bar(text: str) -> Progress | None:
    found = find_bar(text)
    return found[0] if found else None
