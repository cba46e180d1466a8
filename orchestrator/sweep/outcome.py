"""What a searched point teaches: its value (the median of its benchmark's repeats), the cause of its crash,
the bounds it broke. Reads the store, writes nothing.

A crash whose cause the log names (out of memory, the KV cache too small, settings that cannot work
together) marks its region infeasible; any other failure, an invalid benchmark, or a run without the
objective is no value at all (the optimizer is told the trial failed, and learns nothing from it).
"""

from __future__ import annotations

import math
import statistics

from ..logparse import hints
from ..store import Store
from ..store.record import RunRecord
from .space import Constraint

# Error kinds (logparse/errors.py) that are the settings' doing: the same point would crash again.
CONFIG_ERROR = "config error"
CAUSE_KINDS = {"cuda_oom": "out of memory", "config_error": CONFIG_ERROR}
# Diagnoses (logparse/hints.py) that name the settings, whatever the error's kind.
KV_TOO_SMALL = "KV cache too small"
CAUSE_SIGNATURES = {
    "kv_cache_blocks": KV_TOO_SMALL, "cpu_kv_cache_blocks": KV_TOO_SMALL,
    # vLLM's 'max seq len ... larger than ... KV cache': the cache cannot hold one request of max_model_len
    "kv_cache_too_small": KV_TOO_SMALL, "cpu_kv_cache_too_small": KV_TOO_SMALL,
    "sglang_mem_fraction": KV_TOO_SMALL, "max_model_len_derived": "config error",
    "startup_free_memory": "out of memory", "cpu_startup_memory": "out of memory",
}
# The spec keys a cause concerns, by the words of their names (matched in the key's last dotted part): a
# KV cache too small is its size, the memory share it comes from, or the request length it must hold. A
# cause not listed here concerns keys no one can name from the log (out of memory: almost any setting).
CAUSE_KEYS = {
    KV_TOO_SMALL: ("kv_cache", "gpu_memory_utilization", "mem_fraction", "max_model_len", "context_length",
                   "num_gpu_blocks", "max_total_tokens", "kvcache"),
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


def concerns(cause: str, key: str) -> bool:
    """Whether a crash's cause is known to hang on a spec key (CAUSE_KEYS); False when the cause names none."""
    name = key.rsplit(".", 1)[-1].lower()
    return any(word in name for word in CAUSE_KEYS.get(cause, ()))


def median_of_repeats(samples: dict[str, list[float]], repeats: int) -> dict[str, float]:
    """Each metric's median over its last `repeats` finite samples (a benchmark run N times on one server
    records one sample per repeat); a metric with none is left out."""
    found = {}
    for name, values in samples.items():
        last = [float(v) for v in values[-repeats:] if isinstance(v, (int, float)) and math.isfinite(v)]
        if last:
            found[name] = statistics.median(last)
    return found


def repeats_of(run: RunRecord) -> int:
    """How many times the run's benchmark ran on its one server (its receipt's `repeats`; 1 without one)."""
    n = (run.receipt or {}).get("repeats")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def measured(store: Store, run: RunRecord) -> dict[str, float]:
    """A point's metrics, as a sweep ranks and bounds it: the latest of each, except that a run whose
    benchmark repeated counts each metric's median over the repeats. One benchmark on a loaded host is one
    draw of its noise (tens of percent apart on shared CPUs); the median of a few is the run's measure."""
    latest = store.latest_metrics(run.id)
    n = repeats_of(run)
    return latest if n == 1 else {**latest, **median_of_repeats(store.metric_values(run.id), n)}


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


