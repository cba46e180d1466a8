"""Run specs: the Pydantic base every playbook's spec extends, and loading from TOML and `--set`."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator

from ..errors import OrchError, SpecError
from ..secret_env import MASK, masked_env
from . import specdoc
from .checks import DAY_S, GPUS_MAX, NODES_MAX, bad_env_names, passable


class RunSpec(BaseModel):
    """Fields every playbook understands. The config and the `*` validator apply to every field of every
    playbook's Spec too: floats must be finite and no string may hold a NUL byte."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the job (secrets: see secret_env)")
    secret_env: list[str] = Field(default_factory=list, max_length=1000,
                                  description="env names stored and shown as *** besides those that look secret "
                                              "(a word ending in TOKEN, KEY, SECRET, PASSWORD, or PAT, PASS; not "
                                              "*_PATH, *_FILE) and values holding a URL's password; *** in env: "
                                              "the value of that variable in orch's environment")
    poll_min: float | None = Field(default=None, gt=0, le=DAY_S, description="first poll interval, s (host default)")
    poll_max: float | None = Field(default=None, gt=0, le=DAY_S, description="longest poll interval, s (host default)")
    stall_factor: float = Field(default=5.0, gt=1, le=1000, description="stalled after this many usual gaps")
    on_stall: Literal["warn", "kill", "dump"] = Field(default="warn", description="what a stall does (dump: py-spy)")
    cleanup: bool = Field(default=True, description="stop stale orch runs on the GPUs and wait until free")
    gpus: list[int] | None = Field(default=None, max_length=GPUS_MAX, description="GPU indices the run needs (default: all)")
    kill_foreign: bool = Field(default=False, description="also kill processes orch did not start")
    patches: list[str] = Field(default_factory=list, description="patch sets applied before launch: names, or "
                               "folders of your own (./my-set, relative to the workspace)")
    python: str | None = Field(default=None, description="interpreter on the host (default: the host's)")
    notify: list[str] = Field(default_factory=list, description="http(s) URLs told (JSON POST) when the run ends")
    notify_timeout_s: float = Field(default=30.0, gt=0, le=DAY_S, description="bound on retries of one notification")
    nodes: int = Field(default=1, ge=1, le=NODES_MAX, description="hosts the run spans (one rank each: its node)")

    _passable = field_validator("*")(classmethod(lambda cls, value: passable(value)))

    @field_validator("notify")
    @classmethod
    def _notify_urls(cls, urls: list[str]) -> list[str]:
        from urllib.parse import urlsplit

        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() or not c.isprintable() for c in url):
                raise ValueError(f"not an http(s) URL: {url!r}")
        return urls

    @field_validator("env", "secret_env")
    @classmethod
    def _env_names(cls, names: Any) -> Any:
        bad = bad_env_names(names)
        if bad:
            raise ValueError(f"not environment variable names: {', '.join(map(repr, bad))}")
        return names

    @field_serializer("env")
    def _masked_env(self, env: dict[str, str]) -> dict[str, str]:
        # every dump is one that is stored or shown: the job's script takes `env` itself, never a dump
        return masked_env(env, self.secret_env)

    @field_validator("gpus")
    @classmethod
    def _gpu_indices(cls, gpus: list[int] | None) -> list[int] | None:
        if gpus is not None and (len(set(gpus)) != len(gpus) or any(not 0 <= g < GPUS_MAX for g in gpus)):
            raise ValueError(f"GPU indices must be distinct, from 0 to {GPUS_MAX - 1}")
        return gpus


def check_regex(pattern: str | None) -> str | None:
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"invalid regular expression: {exc}") from None
    return pattern


def parse_value(text: str) -> Any:
    """A `--set` value: a TOML literal when it parses as one (`[2,30]`, `true`, `4`), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _wants_text(spec_cls: type[BaseModel] | None, path: list[str]) -> bool:
    """Whether a field only takes strings, so `--set cmd=true` means the text "true", not a boolean."""
    if spec_cls is None or path[0] not in spec_cls.model_fields:
        return False
    annotation = spec_cls.model_fields[path[0]].annotation
    if len(path) == 2 and get_origin(annotation) is dict:
        return get_args(annotation)[1] is str
    return len(path) == 1 and (annotation is str or set(get_args(annotation)) == {str, type(None)})


def merge_sets(values: dict[str, Any], sets: list[str], spec_cls: type[BaseModel] | None = None) -> dict[str, Any]:
    """Apply `key=value` (dotted keys reach into tables, e.g. `env.NCCL_DEBUG=INFO`)."""
    merged = dict(values)
    for item in sets:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError(f"--set expects key=value, got {item!r}")
        *parents, leaf = key.split(".")
        table = merged
        for part in parents:
            child = table.get(part)
            table[part] = child = dict(child) if isinstance(child, dict) else {}
            table = child
        table[leaf] = raw if _wants_text(spec_cls, [*parents, leaf]) else parse_value(raw)
    return merged


S = TypeVar("S", bound=BaseModel)


def build(spec_cls: type[S], values: dict[str, Any], source: str = "spec",
          origin: Callable[[str], str] | None = None) -> S:
    """Validate; every invalid field is reported, one per line (origin names where a key came from)."""
    try:
        spec = spec_cls.model_validate(values)
    except ValidationError as exc:
        lines = specdoc.problems(spec_cls, exc, origin)
        if len(lines) == 1:
            raise SpecError(f"invalid {source}: {lines[0]}") from None
        raise SpecError(f"invalid {source}, {len(lines)} problems:\n" + "\n".join(lines)) from None
    return with_secrets(spec) if isinstance(spec, RunSpec) else spec


def masked(spec: S) -> S:
    """The spec with its secrets masked in `env` itself: for what prints a job's script (a dry run)."""
    assert isinstance(spec, RunSpec)
    return spec.model_copy(update={"env": masked_env(spec.env, spec.secret_env)})


def with_secrets(spec: S) -> S:
    """The spec with each `env` value MASK replaced by that variable's value in orch's environment: a run
    started again from its record (rerun, a sweep resumed, the dashboard's command) never hands the job
    the mask. A value that cannot be found is an error, before anything starts."""
    assert isinstance(spec, RunSpec)
    wanted = [k for k, v in spec.env.items() if v == MASK]
    if not wanted:
        return spec
    missing = [k for k in wanted if not os.environ.get(k)]
    if missing:
        keys = ", ".join(f"env.{k}" for k in missing)
        raise SpecError(f"{keys} {'is' if len(missing) == 1 else 'are'} {MASK} (a secret as orch stores it) and "
                        f"orch's environment has no {', '.join(missing)}: export {missing[0]}=... before running, "
                        "or give the value")
    return spec.model_copy(update={"env": {k: os.environ[k] if v == MASK else v for k, v in spec.env.items()}})


def stored(spec_cls: type[S], run_id: int, value: Any, readable: bool = True) -> S:
    """A run's spec as the database holds it; one that cannot be read or no longer validates (a database
    written by an older orch, or edited by hand) is an error naming the run, not a traceback."""
    if not readable:
        raise OrchError(f"run {run_id}: its stored spec is not valid JSON; orch cannot act on this run")
    try:
        return spec_cls.model_validate(value)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg'].removeprefix('Value error, ')}"
                    for e in exc.errors()]
        raise OrchError(f"run {run_id}: its stored spec no longer validates ({'; '.join(problems)});"
                        " orch cannot act on this run") from None


def load(spec_cls: type[S], file: Path | None = None, sets: list[str] | None = None) -> S:
    values: dict[str, Any] = {}
    if file is not None:
        try:
            values = tomllib.loads(Path(file).read_text())
        except FileNotFoundError:
            raise SpecError(f"spec file not found: {file}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise SpecError(f"{file}: invalid TOML: {exc}") from None
        except OSError as exc:  # a directory, no permission
            raise SpecError(f"cannot read spec file {file}: {exc.strerror or exc}") from None
    set_keys = [item.partition("=")[0].strip() for item in sets or []]

    def origin(key: str) -> str:
        if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in set_keys):
            return "--set"
        return str(file) if file is not None else ""

    return build(spec_cls, merge_sets(values, sets or [], spec_cls), origin=origin)
