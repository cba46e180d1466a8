"""What a searched point teaches: its value, the cause of its crash, the bounds it broke. Pure: no I/O.

A crash whose cause the log names (out of memory, the KV cache too small, settings that cannot work
together) marks its region infeasible; any other failure, an invalid benchmark, or a run without the
objective is no value at all (the optimizer is told the trial failed, and learns nothing from it).
"""

from __future__ import annotations

import math

from ..logparse import hints
from ..store.record import RunRecord
from .space import Constraint

# Error kinds (logparse/errors.py) that are the settings' doing: the same point would crash again.
CONFIG_ERROR = "config error"
CAUSE_KINDS = {"cuda_oom": "out of memory", "config_error": CONFIG_ERROR}
# Diagnoses (logparse/hints.py) that name the settings, whatever the error's kind.
CAUSE_SIGNATURES = {
    "kv_cache_blocks": "KV cache too small", "cpu_kv_cache_blocks": "KV cache too small",
    "sglang_mem_fraction": "KV cache too small", "max_model_len_derived": "config error",
    "startup_free_memory": "out of memory", "cpu_startup_memory": "out of memory",
}
# The OOM killer's own lines: a SIGKILL from anyone else (a person, the scheduler) is no cause.
OOM_KILLER = ("oom-kill", "Out of memory", "oom_kill", "invoked oom-killer")


def cause(run: RunRecord) -> str | None:
    """The settings' fault a failed run's log names, in words; None when it names none."""
    err = run.error or {}
    kind = err.get("kind")
    if not kind:
        return None
    own = "\n".join([f"{err.get('exception') or ''}: {err.get('message') or ''}", *(err.get("chain") or [])])
    found = hints.signature_of(kind, own, "\n".join(err.get("context") or []), run.phase,
                               exception=err.get("exception"))
    if found is not None and found.name in CAUSE_SIGNATURES:
        return CAUSE_SIGNATURES[found.name]
    if kind in CAUSE_KINDS:
        return CAUSE_KINDS[kind]
    if kind == "killed" and any(m in own for m in OOM_KILLER):
        return "out of memory"
    return None


def cause_of(job_failed: bool, reason: str | None, run: RunRecord | None) -> str | None:
    """A failed point's cause, when it is the settings': from its run's log, or a point the playbook refused
    before it ran (its reason says `config error: ...`)."""
    if not job_failed:
        return None
    if run is not None and (found := cause(run)):
        return found
    return CONFIG_ERROR if (reason or "").startswith(CONFIG_ERROR + ":") else None


def invalid(run: RunRecord) -> bool:
    """A benchmark its own checks refused (failed requests, no completion, a server not ready, a GPU not
    clean): its numbers are no value (the run's `invalid` flag, beside its status)."""
    return run.invalid is not None


def value(metrics: dict[str, float], metric: str) -> float | None:
    found = metrics.get(metric)
    return found if found is not None and math.isfinite(found) else None


def violations(constraints: dict[str, Constraint], metrics: dict[str, float]) -> list[float]:
    """One number per bound, in the file's order: > 0 how far outside it (a missing metric is outside)."""
    return [c.violation(value(metrics, m)) for m, c in constraints.items()]


def broken(constraints: dict[str, Constraint], metrics: dict[str, float]) -> list[str]:
    """The bounds a point's metrics break, in words."""
    found = []
    for metric, c in constraints.items():
        v = value(metrics, metric)
        if c.violation(v) > 0:
            found.append(f"{metric} not recorded" if v is None else f"{metric}={v:g} (bound {c.text(metric)})")
    return found


