"""Metrics and progress from any job: a line protocol a user's own script can print.

    orch-metric NAME=VALUE [NAME=VALUE ...]
    orch-progress DONE/TOTAL [LABEL]      (or DONE alone, when the total is not known)

anywhere in a line (after a logging prefix too), e.g. ``print(f"orch-metric loss={loss:.4f} tok_s={rate}")``.
NAME is a letter or '_' then letters, digits, '_', '.', '-' or '/'; VALUE is a number as Python's float()
reads it ('3', '-0.25', '1e-3'; 'nan' and 'inf' are kept as such, a number too large for a float is refused). Pairs are separated by spaces or commas; anything else
in the line (text after the pairs) is ignored. Each pair is recorded like an engine's metric, with the
line's own timestamp when the line carries one, so it shows up in `orch status`, sweeps, `compare` and
reports under NAME. An `orch-progress` line is the run's progress bar (`label done/total` in `orch status`,
the stall detector, the ETA); the label defaults to `progress`.
"""

from __future__ import annotations

import math
import re

PROTOCOL = "orch-metric"
PROGRESS = "orch-progress"

_LINE = re.compile(r"(?:^|[\s:])orch-metric((?:[ ,]+[A-Za-z_][\w.\-/]*=[^\s,]+)+)")
_PAIR = re.compile(r"([A-Za-z_][\w.\-/]*)=([^\s,]+)")
_MAX_PAIRS = 64


_NOT_A_NUMBER = ("nan", "inf", "infinity")


def as_printed(raw: str) -> float | None:
    """A value as the line prints it: a number, or NaN or an infinity written as such (`nan`, `inf`,
    `-Infinity`: a diverged loss is a finding); None for anything else, and for a number too large for a
    float, which is no infinity the program printed."""
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) or raw.strip().lower().lstrip("+-") in _NOT_A_NUMBER else None


def protocol_metrics(text: str) -> list[tuple[str, float]]:
    """(name, value) pairs of an 'orch-metric' line; [] for any other line."""
    m = _LINE.search(text)
    if m is None:
        return []
    found: list[tuple[str, float]] = []
    for name, raw in _PAIR.findall(m.group(1))[:_MAX_PAIRS]:
        value = as_printed(raw)
        if value is not None:
            found.append((name, value))
    return found


_PROGRESS = re.compile(r"(?:^|[\s:])orch-progress\s+(\d+(?:\.\d+)?)(?:/(\d+(?:\.\d+)?))?(?:\s+(\S.{0,199}?))?\s*$")


def protocol_progress(text: str) -> tuple[str, float, float | None] | None:
    """(label, done, total) of an 'orch-progress' line; None for any other line (or a total of 0)."""
    m = _PROGRESS.search(text)
    if m is None:
        return None
    done, total = float(m.group(1)), float(m.group(2)) if m.group(2) else None
    if total is not None and total <= 0:
        return None
    return (m.group(3) or "progress").strip(), done, total
