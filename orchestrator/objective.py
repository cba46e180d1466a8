"""A sweep's objective — one metric and whether more or less of it is better — and the best point by it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Objective(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: str = Field(min_length=1, description="a metric every point records, e.g. output_throughput")
    goal: Literal["max", "min"] = "max"

    def better(self, a: float, b: float) -> bool:
        return a > b if self.goal == "max" else a < b


def best(objective: Objective, points: Iterable[tuple[Any, dict[str, float]]]) -> tuple[Any, float] | None:
    """The key of the best point among (key, metrics) pairs and its value; None when none has the metric.

    A tie keeps the earlier point.
    """
    found: tuple[Any, float] | None = None
    for key, metrics in points:
        value = metrics.get(objective.metric)
        if value is not None and (found is None or objective.better(value, found[1])):
            found = (key, value)
    return found


def of_doc(doc: str | None) -> Objective | None:
    """The objective of a stored sweep file (the sweeps row's `doc`), if it has one."""
    import json

    raw = json.loads(doc).get("objective") if doc else None
    return Objective.model_validate(raw) if raw else None
