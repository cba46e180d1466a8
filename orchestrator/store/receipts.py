"""A run's receipt: what produced its numbers, as one JSON document, and what differs between two.

Recorded at launch and completed at the end (runflow/receipt.py gathers it):
    orch            orch's version                  host, hostname   the inventory's name, the machine's
    playbook        the playbook                    spec             the run's spec (secrets masked)
    engine          {name, version, python, packages: {torch: ...}} as the engine's python reports them
    patches         [{name, set_hash, package, version, files: {file: sha256 after}, reverted}]
    argv            the job's command line          server_argv      the engine server's argv (a server)
    env             the job's environment, secrets masked
    model           {path, files: {config.json: sha256, tokenizer_config.json: ..., generation_config.json: ...}}
    dataset         {name, num_prompts, input_len, output_len, seed}   warmup, repeats
    hardware        {gpus: [{name, driver, ...}], cpu: {model, count}}
    server          a benchmark's server: {run, ready_at_launch, receipt}
    launched_at, ended_at, status, invalid
"""

from __future__ import annotations

import json
from typing import Any

# Keys that differ from run to run without saying anything about what made the numbers.
# (A patch set reverted at the end made the numbers as much as one left applied.)
_MOMENTARY = ("launched_at", "ended_at", "status", "invalid", "server.run", "spec.server", "spec.name", "reverted")
# What makes two runs' numbers incomparable when it differs: another model, data set or machine.
_MATTERS = {"model": "the model", "dataset": "the data set", "hardware.gpus": "the GPUs",
            "hardware.cpu.model": "the CPU", "spec.bench.num_prompts": "the data set"}
_MATTERS_NAMES = ("name",)  # of each GPU: its model (a driver or clock differs: named, still comparable)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys; a list of tables (the GPUs, the patch sets) keyed by position or name."""
    if isinstance(value, dict) and (value or not prefix):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
        return flat
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        flat = {}
        for i, item in enumerate(value):
            flat.update(flatten(item, f"{prefix}{item.get('name', i) if prefix.endswith('patches.') else i}."))
        return flat
    return {prefix[:-1]: value}


def _value(v: Any) -> Any:
    """An empty list or table says no more than a missing one (no patch sets: `[]`, or none recorded)."""
    return None if v in ([], {}) else v


def _momentary(key: str) -> bool:
    return any(key == m or key.startswith(m + ".") or key.endswith("." + m) for m in _MOMENTARY)


def differences(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[dict[str, Any]]:
    """What differs between two receipts, as [{key, a, b, matters}] (dotted keys, in the first's order, then
    the second's); `matters`: what makes the numbers incomparable (another model, data set, GPU), else None."""
    fa, fb = flatten(a or {}), flatten(b or {})
    found = []
    for key in dict.fromkeys([*fa, *fb]):
        if _momentary(key) or _value(fa.get(key)) == _value(fb.get(key)):
            continue
        found.append({"key": key, "a": fa.get(key), "b": fb.get(key), "matters": matters(key)})
    return found


def matters(key: str) -> str | None:
    """Why a difference at `key` makes the numbers incomparable (None: it is a cause to name, not a reason)."""
    bare = key.removeprefix("server.receipt.")
    for prefix, what in _MATTERS.items():
        if bare == prefix or bare.startswith(prefix + "."):
            if prefix == "hardware.gpus" and bare.rsplit(".", 1)[-1] not in _MATTERS_NAMES:
                return None
            return what
    return None


def same_but_time(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Two receipts that differ in nothing but when (the same point of a nightly sweep, nothing changed)."""
    return not differences(a, b)


def line(diff: dict[str, Any]) -> str:
    """One difference as people write it: `key: a -> b`."""
    def show(v: Any) -> str:
        return "-" if v is None else v if isinstance(v, str) else json.dumps(v)
    return f"{diff['key']}: {show(diff['a'])} -> {show(diff['b'])}"
