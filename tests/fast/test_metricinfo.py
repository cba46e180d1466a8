"""Each metric's direction (or none: a count or a setting), and the headlines each playbook leads with."""

from __future__ import annotations

import pytest

from orchestrator.config import metricinfo
from orchestrator.config.metricinfo import direction, headlines, order


@pytest.mark.parametrize("name, expected", [
    ("output_throughput", "higher"), ("gen_throughput", "higher"), ("request_throughput", "higher"),
    ("tokens_per_s", "higher"), ("samples_per_s", "higher"), ("tok_s", "higher"), ("accept_len", "higher"),
    ("draft_accept_rate", "higher"), ("accept_per_draft_slot", "higher"), ("accept_rate_pos_2", "higher"),
    ("train/full_acc_0", "higher"),
    ("median_ttft_ms", "lower"), ("p99_itl_ms", "lower"), ("mean_tpot_ms", "lower"), ("load_weight_s", "lower"),
    ("train/loss", "lower"), ("val/loss", "lower"), ("loss", "lower"), ("avg_latency", "lower"),
    ("median_e2el_ms", "lower"),
    ("completed", None), ("failed", None), ("concurrency", None), ("max_concurrency", None), ("num_prompts", None),
    ("request_rate", None), ("samples", None), ("tokens", None), ("total_input_tokens", None),
    ("spec_accepted_tokens", None), ("spec_draft_tokens", None), ("output_mb", None), ("lr", None),
    ("step", None), ("epoch", None), ("checkpoints", None), ("files", None), ("something_else", None),
])
def test_every_metric_has_a_direction_or_is_a_count(name: str, expected: str | None) -> None:
    assert direction(name) == expected


def test_counts_are_never_objectives_of_the_old_rule() -> None:
    # `tok_s` ends in `_s` yet is a rate: better higher, never a time
    assert direction("tok_s") == "higher" and direction("duration_s") == "lower"


def test_each_kind_of_playbook_leads_with_its_headlines() -> None:
    bench = headlines("bench-serving")
    assert bench[:5] == ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
    assert "accept_len" in bench and headlines("serve-bench") == bench == headlines("serve-bench-vllm")
    assert headlines("serve-vllm")[:2] == ("gen_throughput", "accept_len") == headlines("serve-eagle3")[:2]
    assert "train/loss" in headlines("train-draft")
    assert headlines("extract-hidden-states") == ("samples_per_s",)
    assert headlines("command") == () == headlines("no-such-playbook")
    for names in metricinfo.HEADLINES.values():  # a headline is always something to judge
        assert all(direction(m) is not None for m in names)


def test_order_puts_the_headlines_first_then_the_rest_by_name() -> None:
    recorded = ["completed", "accept_len", "concurrency", "median_itl_ms", "duration_s", "output_throughput",
                "median_ttft_ms"]
    assert order(recorded, "bench-serving") == ["output_throughput", "median_ttft_ms", "median_itl_ms",
                                                "accept_len", "completed", "concurrency", "duration_s"]
    assert order(recorded, None) == sorted(recorded) == order(recorded, "command")


def test_a_plugin_declares_its_own_headlines_but_never_a_builtins() -> None:
    metricinfo.declare("my-bench", ["score", "wall_s"])
    metricinfo.declare("bench-serving", ["completed"])
    assert headlines("my-bench") == ("score", "wall_s")
    assert headlines("bench-serving")[0] == "output_throughput"
    assert order(["wall_s", "a", "score"], "my-bench") == ["score", "wall_s", "a"]


def test_every_builtin_playbook_declares_its_headlines_and_none_on_its_class() -> None:
    from orchestrator.runflow import registry

    assert set(registry.BUILTIN_PLAYBOOKS) <= set(metricinfo.HEADLINES)
    for name in registry.BUILTIN_PLAYBOOKS:  # one place: the built-ins' are read without loading them
        assert registry.playbook(name).headlines == ()
