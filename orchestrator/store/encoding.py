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


# SQLite's REAL holds an infinity but turns NaN into NULL, which reads as "nothing was logged". A NaN is
# stored as this text instead (a REAL column keeps text that is no number as text) and read back as NaN.
NAN_TEXT = "NaN"


def real_in(value: Any) -> Any:
    """A value as a REAL column stores it: NaN as NAN_TEXT, anything else as it is."""
    return NAN_TEXT if isinstance(value, float) and math.isnan(value) else value


def real_out(value: Any) -> Any:
    """A REAL column's value as it was given: NAN_TEXT back to NaN."""
    return math.nan if value == NAN_TEXT else value


def json_safe(value: Any) -> Any:
    """A value for strict JSON with NaN and infinities kept as what they are, spelled as JavaScript and
    Python read them back ("NaN", "Infinity", "-Infinity": float() takes each)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
