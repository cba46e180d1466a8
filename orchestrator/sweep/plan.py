"""The sweep file and its plan: every point expanded from the file and validated before anything starts."""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, model_validator

from .. import runflow
from ..config.hosts import NAME_PATTERN, Host, Inventory
from ..config.objective import Objective
from ..config.workspace import Workspace
from ..errors import UsageError
from ..host.executor import executor_class
from ..runflow import registry
from ..runflow.nodes import check_nodes
from ..store import Store
from . import space
from .space import Constraint, Search


class SweepFile(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # `retry_backoff_s = inf` waits forever

    name: str = Field(pattern=NAME_PATTERN)
    playbook: str
    hosts: list[str] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list)
    spec: dict[str, Any] = Field(default_factory=dict)
    matrix: dict[str, Any] = Field(default_factory=dict)
    include: list[dict[str, Any]] = Field(default_factory=list)
    retries: int = Field(default=1, ge=0, le=100, description="extra attempts for failures that are the fleet's fault")
    retry_backoff_s: float = Field(default=30.0, ge=0, le=86400)
    fail_fast: bool = False
    replace: bool = Field(default=False, description="a point stops the orch run (not of this sweep) holding its host")
    notify: list[str] = Field(default_factory=list, description="URLs told when the sweep finishes")
    objective: Objective | None = Field(default=None, description="the metric (and goal) that picks the best point")
    max_parallel: int | None = Field(default=None, ge=1, le=100_000,
                                     description="at most this many points at once on each cluster host")
    search: dict[str, Any] | None = Field(default=None, description="the points proposed by a search (space.py)")
    constraints: dict[str, Any] = Field(default_factory=dict, description="bounds on metrics other than the objective")

    @model_validator(mode="after")
    def _where(self) -> SweepFile:
        if bool(self.hosts) == bool(self.tags):
            raise ValueError("give either hosts = [...] or tags = [...]")
        if self.search is not None and (self.matrix or self.include):
            raise ValueError("give either [search] or [matrix] / [[include]], not both")
        if self.search is not None and self.objective is None:
            raise ValueError("a search needs objective = { metric = ..., goal = ... }")
        if self.constraints and self.search is None:
            raise ValueError("[constraints] bound a search's points: give [search] too")
        return self

    def searched(self) -> tuple[Search | None, dict[str, Constraint]]:
        """[search] and [constraints] read (None: a grid); UsageError for anything wrong in them."""
        if self.search is None:
            return None, {}
        return space.parse(self.search), space.constraints(self.constraints)

    @field_serializer("spec")
    def _masked_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        # stored with the sweep: its secrets as a run's spec stores them
        from ..secret_env import masked_values

        return masked_values(spec)


@dataclass(frozen=True)
class Point:
    index: int
    diff: dict[str, Any]  # dotted key -> value: what this point changes in the base spec
    spec: Any  # the playbook's Spec, validated
    host: str  # its head, for a point across several hosts
    cluster: bool = False  # its host has a scheduler, which picks the GPUs
    hosts: tuple[str, ...] = ()  # a point across several hosts: all of them, its head first

    @property
    def key(self) -> str:
        return point_key(self.diff)

    @property
    def label(self) -> str:
        return label(self.diff)

    @property
    def lane(self) -> str:
        gpus = self.spec.gpus
        # a cluster's points share one lane, as wide as max_parallel: the scheduler places them
        where = "+".join(self.hosts) or self.host  # the hosts' leases, taken all or none, keep lanes apart
        return where if gpus is None or self.cluster else f"{where}:{','.join(map(str, sorted(gpus)))}"


@dataclass
class Plan:
    path: Path
    file_hash: str
    file: SweepFile
    playbook: Any
    hosts: list[Host]
    points: list[Point]
    instance: str = ""  # with name and file_hash, which sweep this is: '' unless the caller names one
    search: Search | None = None  # a search: its points are proposed as it goes, `points` is empty
    constraints: dict[str, Constraint] = field(default_factory=dict)

    def point(self, index: int, diff: dict[str, Any], host: Host, gpus: list[int] | None = None) -> Point:
        """A searched point on one host (and GPU set), its spec built and checked as a grid's are."""
        from ..config import spec as specmod

        values = _apply(self.file.spec, diff)
        if gpus is not None:
            values["gpus"] = gpus
        spec = specmod.build(self.playbook.Spec, values, source=f"point {index} ({label(diff)})")
        return Point(index, diff, spec, host.name, cluster=executor_class(host).schedules_gpus)


def point_key(diff: dict[str, Any]) -> str:
    return json.dumps(diff, sort_keys=True)


def label(diff: dict[str, Any]) -> str:
    return " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in diff.items()) or "base spec"


# the file -------------------------------------------------------------------------------------------
def _read(path: Path) -> tuple[str, dict[str, Any]]:
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, IsADirectoryError):
        raise UsageError(f"sweep file not found: {path}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not text: {exc}") from None
    try:
        return text, tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: invalid TOML: {exc}") from None


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def load(path: Path) -> SweepFile:
    """Parse and check a sweep file on its own (no inventory, no playbook spec)."""
    _, raw = _read(path)
    try:
        file = SweepFile.model_validate(raw)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc'])) or 'sweep'}: {e['msg'].removeprefix('Value error, ')}"
                    for e in exc.errors()]
        raise UsageError(f"{path}: invalid sweep: " + "; ".join(problems)) from None
    try:
        file.searched()
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from None
    expand(file)
    return file


def identity(path: Path) -> tuple[str, str]:
    """The name and file hash a file's sweeps are recorded under (UsageError if it does not parse)."""
    text, _ = _read(path)
    return load(path).name, _hash(text)


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def expand(file: SweepFile) -> list[dict[str, Any]]:
    """Every point's differences: the matrix's combinations in order, then the includes not already there
    (a search has none: it proposes them as it goes)."""
    if file.search is not None:
        return []
    axes = _flatten(file.matrix)
    for key, values in axes.items():
        if not isinstance(values, list) or not values:
            raise UsageError(f"matrix.{key}: expected a non-empty list of values")
    diffs = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] if axes else []
    for n, extra in enumerate(file.include):
        diff = _flatten(extra)
        if not diff:
            raise UsageError(f"include[{n}]: an empty point")
        diffs.append(diff)
    _no_swept_secret(file, axes, diffs)
    unique: list[dict[str, Any]] = []  # a repeated value or an include already in the grid: one point
    for diff in diffs:
        if diff not in unique:
            unique.append(diff)
    return unique or [{}]


def _no_swept_secret(file: SweepFile, axes: dict[str, Any], diffs: list[dict[str, Any]]) -> None:
    """A point's swept values are its label in status, reports and notifications: a secret cannot be one."""
    from ..secret_env import is_secret

    marked = file.spec.get("secret_env")
    marked = set(marked) if isinstance(marked, list) else set()
    for diff in diffs:
        for key, value in diff.items():
            pairs = (list(value.items()) if key == "env" and isinstance(value, dict)
                     else [(key.removeprefix("env."), value)])
            if (key == "env" or key.startswith("env.")) and any(is_secret(n, v, marked) for n, v in pairs):
                where = "matrix" if key in axes else "include"
                raise UsageError(f"{where}.{key}: a secret cannot be swept (its values would show in each point's "
                                 "label); give it in [spec]")


def _apply(base: dict[str, Any], diff: dict[str, Any]) -> dict[str, Any]:
    values = copy.deepcopy(base)
    for dotted, value in diff.items():
        if dotted.startswith("env.") and not isinstance(value, str):
            value = json.dumps(value)  # a searched number for the job's environment: its text
        *parents, leaf = dotted.split(".")
        table = values
        for part in parents:
            if not isinstance(table.get(part), dict):
                table[part] = {}
            table = table[part]
        table[leaf] = copy.deepcopy(value)
    return values


def plan(ws: Workspace, store: Store, path: Path, instance: str = "") -> Plan:
    """Validate everything — the file, the hosts, every point's spec — before anything starts."""
    from ..config import spec as specmod

    path = Path(path).expanduser().resolve()
    text, _ = _read(path)
    file = load(path)
    pb = registry.playbook(file.playbook)
    inv = Inventory.load(ws.hosts_file, ws.root)
    hosts = inv.select(file.hosts or None, file.tags or None)
    if not hosts:
        raise UsageError(f"{path}: no host of the inventory has the tags {', '.join(file.tags)}")
    search, constraints = file.searched()
    if search is not None:
        _check_space(file, pb, hosts, search, path, store)
        return Plan(path, _hash(text), file, pb, hosts, [], instance, search, constraints)
    points = []
    for i, diff in enumerate(expand(file)):
        host = hosts[i % len(hosts)]
        spec = specmod.build(pb.Spec, _apply(file.spec, diff), source=f"point {i} ({label(diff)})")
        cluster = executor_class(host).schedules_gpus
        # a point across several hosts takes `nodes` of the sweep's hosts in turn (a cluster places its own)
        span = [hosts[(i + k) % len(hosts)] for k in range(spec.nodes)] if spec.nodes > 1 and not cluster else [host]
        try:
            if len(span) > 1:
                if len(hosts) < spec.nodes:
                    raise UsageError(f"nodes = {spec.nodes} but the sweep has {len(hosts)} hosts")
                if file.replace:
                    raise UsageError("replace = true takes points on one host")
                check_nodes(pb, spec, span)
            for one in span:
                runflow.check(store, pb, spec, one)
        except UsageError as exc:
            raise UsageError(f"invalid point {i} ({label(diff)}): {exc}") from None
        points.append(Point(i, diff, spec, host.name, cluster=cluster,
                            hosts=tuple(h.name for h in span) if len(span) > 1 else ()))
    return Plan(path, _hash(text), file, pb, hosts, points, instance)


def _check_space(file: SweepFile, pb: Any, hosts: list[Host], search: Search, path: Path, store: Store) -> None:
    """Every key of the space, at each of its bounds and choices, makes a valid spec on every host: a typo
    or a value the playbook refuses is found before anything starts (a later stage's keys with the
    earlier stages' at their lower bounds)."""
    from ..config import spec as specmod

    if search.gpu_sets and any(executor_class(h).schedules_gpus for h in hosts):
        raise UsageError(f"{path}: search.gpu_sets: a cluster's scheduler places the GPUs")
    base: dict[str, Any] = {}
    for stage in search.stages:
        for key, dim in stage.space.items():
            for value in dim.corners():
                diff = {**base, key: value}
                spec = specmod.build(pb.Spec, _apply(file.spec, diff), source=f"search.{key} = {value!r}")
                if spec.nodes > 1:
                    raise UsageError(f"{path}: a search's points run on one host each (nodes = {spec.nodes})")
                for host in hosts:
                    try:
                        runflow.check(store, pb, spec, host)
                    except UsageError as exc:
                        raise UsageError(f"search.{key} = {value!r} on {host.name}: {exc}") from None
        base.update({k: d.corners()[0] for k, d in stage.space.items()})
