"""Secrets in a run's `env`: which names look secret, and a spec with their values masked. A leaf: the
store masks what it keeps with it, the config layer what it shows."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# Secrets in `env`: a value whose name looks secret, or is listed in `secret_env`, is stored and shown as
# MASK (the database, runs/<id>/spec.json, status, the dashboard, compare, reports); the job gets the real
# one. A run started again from its record finds MASK there, so MASK in `env` means "the value of this
# variable in orch's own environment", taken when the run is built (`build`).
MASK = "***"
# One of the name's `_`-separated words ends in one of these (a plural, a number after it): HF_TOKEN,
# WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, PGPASSWORD, APIKEY2; not TOKENIZERS_PARALLELISM or KEYBOARD, which
# only start with one.
_SECRET_WORD = re.compile(r"(?:TOKEN|KEY|SECRET|PASSWORD|PASSWD)S?\d*$", re.IGNORECASE)


def looks_secret(name: str) -> bool:
    return any(_SECRET_WORD.search(word) for word in name.split("_"))


def masked_env(env: Mapping[str, Any], marked: Iterable[str] = ()) -> dict[str, Any]:
    """`env` with the values of secret names replaced by MASK (an empty value hides nothing: it stays)."""
    marked = set(marked)
    return {k: MASK if v not in ("", None) and (k in marked or looks_secret(k)) else v for k, v in env.items()}


def masked_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """A spec as plain values (a sweep file's `[spec]`, a stored spec) with its secrets masked."""
    env, marked = values.get("env"), values.get("secret_env")
    if not isinstance(env, Mapping):
        return dict(values)
    names = [m for m in marked if isinstance(m, str)] if isinstance(marked, list) else []
    return {**values, "env": masked_env(env, names)}
