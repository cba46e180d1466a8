"""A sweep's objective — one metric and whether more or less of it is better — and the best point by it."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from . import metricinfo


def lower_is_better(metric: str) -> bool:
    """A metric's direction, from its name: latencies, load times and losses are better lower."""
    return metricinfo.direction(metric) == "lower"


def goal_of(metric: str) -> Literal["max", "min"]:
    return "min" if lower_is_better(metric) else "max"


class Objective(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metric: str = Field(min_length=1, description="a metric every point records, e.g. output_throughput")
    goal: Literal["max", "min"] = "max"

    @classmethod
    def of_metric(cls, metric: str) -> Objective:
        """A bare metric as an objective, in the metric's own direction."""
        return cls(metric=metric, goal=goal_of(metric))

    def better(self, a: float, b: float) -> bool:
        return a > b if self.goal == "max" else a < b


def best(objective: Objective, points: Iterable[tuple[Any, dict[str, float]]]) -> tuple[Any, float] | None:
    """The key of the best point among (key, metrics) pairs and its value; None when none has the metric.

    A tie keeps the earlier point.
    """
    found: tuple[Any, float] | None = None
    for key, metrics in points:
        value = metrics.get(objective.metric)
        # a NaN or an infinity (a loss that diverged) is kept, never the best
        if value is not None and math.isfinite(value) and (found is None or objective.better(value, found[1])):
            found = (key, value)
    return found


def of_doc(doc: dict[str, Any] | None) -> Objective | None:
    """The objective of a stored sweep file (the sweeps row's `doc`, as read), if it has one."""
    raw = doc.get("objective") if doc else None
    return Objective.model_validate(raw) if raw else None
