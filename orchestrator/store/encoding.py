"""How the store writes and reads its JSON columns: strict JSON only, in one place."""

from __future__ import annotations

import json
import math
from typing import Any


def _finite(value: Any) -> Any:
    """Non-finite floats as null: JSON has no infinity, and a number read from a log (a 400-digit
    counter) can overflow to one."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dump_json(value: Any) -> str | None:
    """Strict JSON only: SQLite's json functions (and every other reader) refuse `Infinity` or `NaN`."""
    return None if value is None else json.dumps(_finite(value), sort_keys=True, allow_nan=False)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(text: str) -> Any:
    """Strict JSON back; ValueError (JSONDecodeError is one) for anything else."""
    return json.loads(text, parse_constant=_refuse_constant)


def decoded(text: str | None) -> Any:
    """A JSON column's value; None for an empty or damaged one (one damaged row must not stop a page)."""
    try:
        return load_json(text) if text else None
    except ValueError:
        return None
