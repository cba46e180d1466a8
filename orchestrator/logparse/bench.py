"""Benchmark result blocks: SGLang's bench_serving (0.4.10 to 0.5.23, also `sglang.benchmark.serving`) and
`vllm bench serve` (and its older benchmarks/benchmark_serving.py), which print the same layout:

    ============ Serving Benchmark Result ============     header: the title centred in 50 '='
    Successful requests:                     1000          rows: '{label:<40} {value:<10}'
    ---------------Time to First Token----------------     sections: a title centred in 50 '-'
    Per-position acceptance (%):                           vLLM: a heading, then '  Position N:' rows
    ==================================================     end

Every numeric row is a metric. Its name is the engines' own result-JSON key where orch knows it (the table
below), else the label in snake case with its unit ('Mean TTFT (ms)' -> mean_ttft_ms). vLLM's
'Acceptance rate (%)' is accepted per drafted token: recorded as fractions `draft_accept_rate` and
`accept_rate`, per position `accept_rate_pos_N`; SGLang's 'Accept length' is `accept_len`.
"""

from __future__ import annotations

import math
import re

_HEADER = re.compile(r"^=+ ?(?:Serving|Offline Throughput) Benchmark Result ?=+$")
_SECTION = re.compile(r"^-+ ?[A-Za-z][\w ().,/-]*? ?-+$")
_END = re.compile(r"^={20,}$")
_ROW = re.compile(r"^(?P<label>\s*[A-Za-z][^:]{0,80}):\s+(?P<value>\S+)\s*$")
_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?$")

# Labels of both engines (every version) whose result-JSON key differs from the label's snake case.
NAMES = {
    "Successful requests": "completed",
    "Failed requests": "failed",
    "Benchmark duration (s)": "duration_s",
    "Total input tokens": "total_input_tokens",
    "Total generated tokens": "total_output_tokens",
    "Total generated tokens (retokenized)": "total_output_tokens_retokenized",
    "Request throughput (req/s)": "request_throughput",
    "Input token throughput (tok/s)": "input_throughput",
    "Output token throughput (tok/s)": "output_throughput",
    "Peak output token throughput (tok/s)": "peak_output_throughput",
    "Total token throughput (tok/s)": "total_token_throughput",
    "Total Token throughput (tok/s)": "total_token_throughput",  # vLLM before 0.9
    "Max request concurrency": "max_concurrency",
    "Maximum request concurrency": "max_concurrency",
    "Request rate configured (RPS)": "request_rate",
    "Traffic request rate": "request_rate",
    "Accept length": "accept_len",
    "Acceptance length": "accept_len",
    "Drafts": "spec_drafts",
    "Draft tokens": "spec_draft_tokens",
    "Accepted tokens": "spec_accepted_tokens",
}
_PERCENT = {"Acceptance rate (%)": ("draft_accept_rate", "accept_rate")}
_POSITION = re.compile(r"^Position (\d+)$")
_UNIT = re.compile(r"\s*\(([^)]*)\)$")


def header(text: str) -> bool:
    return "Benchmark Result" in text and bool(_HEADER.match(text.strip()))


def end(text: str) -> bool:
    return bool(_END.match(text.strip()))


def section(text: str) -> bool:
    return text[:1] == "-" and bool(_SECTION.match(text.strip()))


def name_of(label: str) -> str:
    """A row's metric name: the engines' key, else the label in snake case ending in its unit when that is
    a time or a percentage."""
    if label in NAMES:
        return NAMES[label]
    unit = ""
    m = _UNIT.search(label)
    if m:
        unit = {"ms": "_ms", "s": "_s", "%": "_pct"}.get(m.group(1), "")
        label = label[:m.start()]
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_") + unit


def row(text: str) -> list[tuple[str, float]]:
    """The metrics of one row of a result block ([] for a heading, text or a value that is no number)."""
    m = _ROW.match(text)
    if m is None or not _NUMBER.match(m.group("value")):
        return []
    label, value = m.group("label").strip(), float(m.group("value"))
    if not math.isfinite(value):
        return []
    position = _POSITION.match(label)
    if position:
        return [(f"accept_rate_pos_{position.group(1)}", value / 100)]
    if label in _PERCENT:
        return [(name, value / 100) for name in _PERCENT[label]]
    return [(name_of(label), value)]


_N = r"(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
# Tools that print their results as lines, not a block: SGLang's bench_one_batch (each run: prefill, median
# decode, total; source python/sglang/bench_one_batch.py), `vllm bench throughput` and `vllm bench latency`
# (vllm/benchmarks/throughput.py, latency.py). Names are the keys of each tool's result JSON; the phase is
# what the line says of the run: a measurement taken ('running'), or the tool's last word ('finished').
LINES: list[tuple[re.Pattern[str], tuple[str, ...], str]] = [
    (re.compile(r"^Prefill\. +latency: " + _N + r" s, throughput: +" + _N + " token/s"),
     ("prefill_latency", "prefill_throughput"), "running"),
    (re.compile(r"^Decode\. +median latency: " + _N + r" s, median throughput: +" + _N + " token/s"),
     ("median_decode_latency", "median_decode_throughput"), "running"),
    (re.compile(r"^Total\. +latency: +" + _N + r" s, throughput: +" + _N + " token/s"),
     ("total_latency", "overall_throughput"), "running"),
    # 'Throughput: 12.11 requests/s, 13952.38 total tokens/s, 1550.27 output tokens/s'; before 0.5 the second
    # number had no 'total' and the third was not printed.
    (re.compile(r"^Throughput: " + _N + r" requests/s(?:, " + _N + r" (?:total )?tokens/s)?(?:, " + _N
                + " output tokens/s)?"),
     ("request_throughput", "total_token_throughput", "output_throughput"), "finished"),
    (re.compile(r"^Avg latency: " + _N + " seconds"), ("avg_latency",), "finished"),
]


def result_line(text: str) -> tuple[list[tuple[str, float]], str] | None:
    """The metrics and the phase of a tool's result line; None for any other line."""
    if "latency: " not in text and "Throughput: " not in text:
        return None
    t = text.strip()
    for pattern, names, phase in LINES:
        m = pattern.match(t)
        if m:
            return [(n, float(v)) for n, v in zip(names, m.groups()) if v is not None], phase
    return None


def engine_of(label: str) -> str | None:
    """The tool a row's label belongs to: SGLang's block starts with 'Backend:'; only vLLM's counts
    failures."""
    if label.startswith(("Backend:", "Accept length:", "Total generated tokens (retokenized)")):
        return "sglang"
    if label.startswith(("Failed requests:", "Maximum request concurrency:", "Request rate configured",
                         "Acceptance rate (%)", "Per-position acceptance")):
        return "vllm"
    return None
