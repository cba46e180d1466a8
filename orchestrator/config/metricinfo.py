"""What orch knows about a metric by its name: its direction, and which metrics a playbook's runs lead with.

A metric is better `higher` (throughputs, rates per second, acceptance), better `lower` (latencies, times,
losses), or neither: a count or a setting (`completed`, `failed`, `max_concurrency`, `num_prompts`, `samples`,
`lr`, `step`), which says what a run did or was asked, never how well. A name orch cannot place has no
direction either: it is shown, never judged.

A playbook's headline metrics are the numbers a person reads first (summaries, `orch status`, `orch compare`,
sweep tables, the report, the dashboard). The built-ins' are declared here, by playbook name, so that reading
them loads no playbook; a third-party playbook declares its own as the `headlines` class attribute of its
Playbook, taken in when the registry loads it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from .. import state

Direction = Literal["higher", "lower"]

# Counts and settings, by exact name: what the benchmark did or was asked, what a job wrote.
_COUNTS = frozenset({
    "completed", "failed", "concurrency", "max_concurrency", "num_prompts", "request_rate", "samples", "tokens",
    "files", "checkpoints", "step", "epoch", "lr", "data_pt", "hs_safetensors", "bytes", "samples_at_max_length",
    "batch_size", "seq_len", "nodes", "gpus", "tp", "exit_code",
})
# The same by shape; checked before the directions, since `spec_accepted_tokens` is a count, not acceptance.
_COUNT = re.compile(r"^(num|n|total|max|min)_|_(count|tokens|mb|gb|kb|bytes|size)$|(^|/)(lr|step|epoch|"
                    r"global_step|iteration|learning_rate)$|grad_norm")
_HIGHER = re.compile(r"throughput|goodput|per_s$|per_sec|(^|_)(tok|tokens|samples|req|requests|it)_s$|/s$"
                     r"|accept|(^|[/_])acc(_|\d|$)|accuracy|reward|hit_rate|(^|_)tps$")
_LOWER = re.compile(r"loss|perplexity|(^|_)ppl$|latency|ttft|tpot|itl|e2el|_ms$|_s$|_sec$|_seconds$|_time$|elapsed")

_BENCHMARK = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "accept_len",
              "draft_accept_rate")
_SERVER = ("gen_throughput", "accept_len", "draft_accept_rate", "accept_per_draft_slot")
# The built-in playbooks' headlines (a playbook of a plugin declares its own: see `declare`).
HEADLINES: dict[str, tuple[str, ...]] = {
    "bench-serving": _BENCHMARK,
    "serve-bench": _BENCHMARK,
    "serve-bench-vllm": _BENCHMARK,
    "serve-eagle3": _SERVER,
    "serve-sglang": _SERVER,
    "serve-vllm": _SERVER,
    "train-draft": ("train/loss", "val/loss", "loss"),
    "extract-hidden-states": ("samples_per_s",),
    "command": (),
}


def is_count(metric: str) -> bool:
    """A count or a setting (`completed`, `max_concurrency`, `lr`): what a run did or was asked, never how well."""
    name = metric.lower()
    return name in _COUNTS or bool(_COUNT.search(name))


def direction(metric: str) -> Direction | None:
    """`higher` or `lower` when more or less of the metric is better; None for a count, a setting or a name
    orch cannot place (never an objective, never coloured better or worse)."""
    name = metric.lower()
    if is_count(name):
        return None
    if _HIGHER.search(name):
        return "higher"
    if _LOWER.search(name):
        return "lower"
    return None


def declare(playbook: str, metrics: Iterable[str]) -> None:
    """A plugin playbook's headlines (the registry passes its class's `headlines`); a built-in's stay."""
    if playbook not in HEADLINES:
        state.current().headlines[playbook] = tuple(metrics)


def headlines(playbook: str) -> tuple[str, ...]:
    """The playbook's headline metrics, in the order a person reads them; () when it declares none."""
    return HEADLINES.get(playbook) or state.current().headlines.get(playbook, ())


def order(metrics: Iterable[str], playbook: str | None) -> list[str]:
    """The metrics as they are shown: the playbook's headlines among them first, in their order, then the
    rest by name."""
    names = set(metrics)
    first = [m for m in headlines(playbook) if m in names] if playbook else []
    return first + sorted(names - set(first))


def is_headline(metric: str, playbook: str | None) -> bool:
    return playbook is not None and metric in headlines(playbook)
