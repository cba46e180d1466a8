"""Checks every value from a file or the command line must pass, whichever model it lands in."""

from __future__ import annotations

import math
import re
from typing import Any

# What bash accepts as a variable name; `str.isidentifier` would also take non-ASCII letters.
# No setting orch knows of comes near this; a bigger number overflows a timedelta, a sleep or a
# shell's arithmetic. Fields have tighter ranges of their own: this holds for any playbook's.
MAGNITUDE_MAX = 1e15
DAY_S = 86400.0  # no poll interval or timeout is longer than this
GPUS_MAX = 1024  # GPUs on one host, far beyond any machine
NODES_MAX = 256  # hosts one run spans
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def value_problem(value: Any) -> str | None:
    """Why a value cannot be passed on: a NUL byte (C strings, and so every remote argument, end there)
    or a float that is not finite (JSON has no infinity, and no wait can last forever), or a number too
    large for any setting. None when fine."""
    if isinstance(value, str):
        return "contains a NUL byte" if "\x00" in value else None
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a finite number"
    if isinstance(value, (int, float)) and abs(value) > MAGNITUDE_MAX:
        shown = f"{value:g}" if isinstance(value, float) or len(str(abs(value))) < 300 else f"a {len(str(value))}-digit number"
        return f"{shown} is too large (at most {MAGNITUDE_MAX:g})"
    if isinstance(value, dict):
        items: list[Any] = [*value.keys(), *value.values()]
        return next((p for p in map(value_problem, items) if p), None)
    if isinstance(value, (list, tuple, set, frozenset)):
        return next((p for p in map(value_problem, value) if p), None)
    return None


def bad_env_names(names: Any) -> list[str]:
    return [name for name in names if not (isinstance(name, str) and ENV_NAME.fullmatch(name))]


def unprintable(text: str) -> str | None:
    """The first character that is not printable (newline, other controls, line separators), as U+XXXX."""
    for char in text:
        if not char.isprintable():
            return f"U+{ord(char):04X}"
    return None


def passable(value: Any) -> Any:
    """The value, or ValueError naming what no field may hold (a Pydantic validator for every field)."""
    problem = value_problem(value)
    if problem:
        raise ValueError(problem)
    return value
