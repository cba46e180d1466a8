"""How the CLI shows things: the two consoles, JSON, tables, the progress line, ages."""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

# No markup: run output, log lines and error messages are data, and `[rank3]` must print as itself.
out = Console(highlight=False, soft_wrap=True, markup=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)


def emit_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


def progress_line(progress: dict[str, Any] | None, phase: str | None) -> str:
    p = progress or {}
    phase = phase or "?"
    if not p:
        return f"{phase}"
    total = p.get("total")
    frac = (p["done"] / total) if total else None
    bar = ""
    if frac is not None:
        filled = int(30 * min(max(frac, 0), 1))
        bar = "" + "█" * filled + "" + "░" * (30 - filled) + f" {100 * frac:5.1f}% "
    eta = f" eta {p['eta_s']:.0f}s" if p.get("eta_s") is not None else ""
    rate = f" {p['rate_per_s']:.2f}/s" if p.get("rate_per_s") else ""
    done = f"{p['done']:g}/{total:g}" if total else f"{p['done']:g}"
    return f"{phase} {p.get('label') or ''} {bar}{done}{rate}{eta}"


def cell(value: Any) -> str:
    if value is None:
        return ""
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
