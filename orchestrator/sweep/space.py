"""A searching sweep's file: `[search]` (the trials, the space of dotted spec keys, the stages) and
`[constraints]` (bounds on other metrics). Pure: no optimizer imported here (see search.py)."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import UsageError

# [search]'s own settings; any other key whose value is a table with low/high or choices is a dimension
PRUNERS = ("median", "percentile", "hyperband", "successive_halving", "none")


class Dimension(BaseModel):
    """One spec key's range: numbers from low to high (log-scaled, in steps), or one of some choices."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = Field(default=None, gt=0)
    choices: list[Any] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _shape(self) -> Dimension:
        if self.choices is not None:
            if self.low is not None or self.high is not None or self.log or self.step is not None:
                raise ValueError("give either choices = [...] or low/high, not both")
            if any(isinstance(c, (dict, list)) for c in self.choices):
                raise ValueError("choices are numbers, strings or booleans")
            return self
        if self.low is None or self.high is None:
            raise ValueError("give low and high (or choices = [...])")
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) is above high ({self.high:g})")
        if self.log and self.low <= 0:
            raise ValueError("log = true needs low > 0")
        if self.log and self.step is not None:
            raise ValueError("log = true and step cannot go together")
        return self

    @property
    def integer(self) -> bool:
        """Whole numbers only: low, high (and step) written as integers."""
        return self.choices is None and self._written_int

    _written_int: bool = False

    def corners(self) -> list[Any]:
        """The values a plan checks against the playbook's spec before anything starts."""
        if self.choices is not None:
            return list(self.choices)
        return [self.cast(self.low), self.cast(self.high)]

    def cast(self, value: Any) -> Any:
        return round(value) if self.integer else float(value)

    def start(self, given: Any) -> Any:
        """The value a search tries first: the spec's own when this range holds it (the setting run today),
        else the middle of the range (geometric with log) or of the choices (of an even number, the later of
        the two middle ones); on the range's step. Not the first choice blindly: lists are often written from
        the smallest, and the smallest size is the one most likely to crash."""
        if self.choices is not None:
            return given if self.contains(given) else self.choices[len(self.choices) // 2]
        assert self.low is not None and self.high is not None
        if isinstance(given, (int, float)) and not isinstance(given, bool) and self.contains(given):
            value = float(given)
        else:
            value = math.sqrt(self.low * self.high) if self.log else (self.low + self.high) / 2
        top = self.high
        if self.step:  # Optuna's grid: low + k * step, never above high
            value = self.low + round((value - self.low) / self.step) * self.step
            top = self.low + math.floor((self.high - self.low) / self.step) * self.step
        return self.cast(min(top, max(self.low, value)))

    def contains(self, value: Any) -> bool:
        """Whether an earlier point's value lies in this range (a warm start keeps only those)."""
        if self.choices is not None:
            return any(value == c and type(value) is type(c) for c in self.choices)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        assert self.low is not None and self.high is not None
        return self.low <= value <= self.high


def _dimension(key: str, raw: dict[str, Any]) -> Dimension:
    try:
        dim = Dimension.model_validate(raw)
    except ValidationError as exc:
        raise UsageError(f"search.{key}: " + "; ".join(e["msg"].removeprefix("Value error, ")
                                                       for e in exc.errors())) from None
    # a range written in whole numbers searches whole numbers (max_num_seqs = { low = 8, high = 256 })
    dim._written_int = all(isinstance(raw.get(k), int) and not isinstance(raw.get(k), bool)
                           for k in ("low", "high", "step") if k in raw)
    return dim


def _is_dimension(value: Any) -> bool:
    return isinstance(value, dict) and bool({"low", "high", "choices"} & value.keys())


def dimensions(table: dict[str, Any], prefix: str = "") -> dict[str, Dimension]:
    """The dotted spec keys of a table and their ranges (TOML's dotted keys arrive as nested tables)."""
    found: dict[str, Dimension] = {}
    for key, value in table.items():
        if _is_dimension(value):
            found[f"{prefix}{key}"] = _dimension(f"{prefix}{key}", value)
        elif isinstance(value, dict):
            found.update(dimensions(value, f"{prefix}{key}."))
        else:
            raise UsageError(f"search.{prefix}{key}: expected {{ low = ..., high = ... }} or {{ choices = [...] }}")
    return found


class Stage(BaseModel):
    """Trials over some keys; a later stage searches its own keys with the best point so far fixed."""

    trials: int
    space: dict[str, Dimension]


class Constraint(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _one(self) -> Constraint:
        if self.min is None and self.max is None:
            raise ValueError("give min = ... or max = ...")
        return self

    def violation(self, value: float | None) -> float:
        """How far a value lies outside the bound, relative to it (<= 0: within); a missing value is outside."""
        if value is None or not math.isfinite(value):
            return 1.0
        worst = 0.0
        if self.max is not None:
            worst = max(worst, (value - self.max) / (abs(self.max) or 1.0))
        if self.min is not None:
            worst = max(worst, (self.min - value) / (abs(self.min) or 1.0))
        return worst

    def text(self, metric: str) -> str:
        return " and ".join(s for s in (f"{metric} >= {self.min:g}" if self.min is not None else "",
                                         f"{metric} <= {self.max:g}" if self.max is not None else "") if s)


class Search(BaseModel):
    """`[search]` read: its settings and stages (the first stage is the keys given in [search] itself)."""

    stages: list[Stage]
    seed: int | None = None
    pruner: Literal["median", "percentile", "hyperband", "successive_halving", "none"] = "median"
    startup_trials: int | None = Field(default=None, ge=0)  # None: derived from the budget (see `startup`)
    warmup_steps: int = 2  # the objective's first samples a trial is never pruned on
    warm_start: bool = False
    gpu_sets: list[list[int]] = Field(default_factory=list)

    @property
    def trials(self) -> int:
        return sum(s.trials for s in self.stages)

    def startup(self, stage: int) -> int:
        """Trials of a stage proposed at random (and pruning held back) before the optimizer models them:
        `startup_trials`, or a quarter of the stage's budget, 2 to 10. Optuna's own 10 suits budgets of a
        hundred; a search of 8 server starts would be random throughout."""
        if self.startup_trials is not None:
            return self.startup_trials
        return min(10, max(2, math.ceil(self.stages[stage].trials / 4)))

    def stage_of(self, diff: dict[str, Any]) -> int:
        """Which stage a recorded point belongs to: the last whose keys it sets."""
        found = 0
        for n, stage in enumerate(self.stages):
            if all(k in diff for k in stage.space):
                found = n
        return found


_SETTINGS = {"trials", "seed", "pruner", "startup_trials", "warmup_steps", "warm_start", "stages", "gpu_sets"}


def _trials(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
        raise UsageError(f"{where}.trials: expected a whole number from 1 to 100000")
    return value


def parse(raw: dict[str, Any]) -> Search:
    """`[search]` as the file gives it; UsageError (one line) for anything wrong."""
    own = {k: v for k, v in raw.items() if k in _SETTINGS and not _is_dimension(v)}
    space = dimensions({k: v for k, v in raw.items() if k not in own})
    if "trials" not in own:
        raise UsageError("search.trials: give how many points to try (trials = N)")
    if not space:
        raise UsageError("search: no key to search (e.g. max_num_seqs = { low = 8, high = 256 })")
    stages = [Stage(trials=_trials("search", own.pop("trials")), space=space)]
    extra = own.pop("stages", [])
    if not isinstance(extra, list) or not all(isinstance(s, dict) for s in extra):
        raise UsageError("search.stages: expected [[search.stages]] tables")
    for n, table in enumerate(extra):
        where = f"search.stages[{n}]"
        if "trials" not in table:
            raise UsageError(f"{where}.trials: give how many points to try")
        keys = dimensions({k: v for k, v in table.items() if k != "trials"})
        if not keys:
            raise UsageError(f"{where}: no key to search")
        seen = set().union(*(s.space for s in stages))
        if again := sorted(seen & keys.keys()):
            raise UsageError(f"{where}: {', '.join(again)} already searched by an earlier stage")
        stages.append(Stage(trials=_trials(where, table["trials"]), space=keys))
    try:
        return Search(stages=stages, **own)
    except ValidationError as exc:
        e = exc.errors()[0]
        raise UsageError(f"search.{'.'.join(map(str, e['loc']))}: {e['msg']}") from None


def constraints(raw: dict[str, Any]) -> dict[str, Constraint]:
    """`[constraints]`: metric = { max = ... } (or min)."""
    found: dict[str, Constraint] = {}
    for metric, bound in raw.items():
        if not isinstance(bound, dict):
            raise UsageError(f"constraints.{metric}: expected {{ max = ... }} or {{ min = ... }}")
        try:
            found[metric] = Constraint.model_validate(bound)
        except ValidationError as exc:
            raise UsageError(f"constraints.{metric}: " + "; ".join(
                e["msg"].removeprefix("Value error, ") for e in exc.errors())) from None
    return found
