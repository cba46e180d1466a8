"""What orch knows of a metric: its direction (is more of it better?) and a playbook's headline metrics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from .objective import lower_is_better


def direction(metric: str) -> Literal["higher", "lower"] | None:
    """Which way the metric improves; None for a count or a setting, which is never an objective."""
    return "lower" if lower_is_better(metric) else "higher"


def headlines(playbook: str) -> tuple[str, ...]:
    """The playbook's headline metrics, in the order a person reads them."""
    return ()


def order(metrics: Iterable[str], playbook: str | None) -> list[str]:
    """Headlines first (in their order), then the rest sorted."""
    names = set(metrics)
    first = [m for m in (headlines(playbook) if playbook else ()) if m in names]
    return first + sorted(names - set(first))
