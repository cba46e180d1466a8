"""SGLang (0.4.10 to 0.5.23) and its bench_serving result block."""

from __future__ import annotations

import re

from .errors import Rule, rule

NAME = "sglang"

# What only SGLang prints (its '[time TPn]' prefix is recognised where lines are cleaned).
DETECT = re.compile(
    r"sglang|The server is fired up|Load weight (?:begin|end)\.|Decode batch[ .,\[]|Prefill batch[ .,\[]"
    r"|server_args=ServerArgs\(|Capture (?:[\w ]+ )?cuda graph (?:begin|end|bs|num tokens)"
    r"|KV Cache is allocated|Memory pool end\.|Init torch distributed (?:begin|ends)|Scheduler hit an exception",
    re.IGNORECASE,
)

RULES: list[Rule] = [
    rule(r"(?:Scheduler|DetokenizerManager|TokenizerManager|DataParallelController|Multi\w*Router)"
         r" hit an exception", "other", True),
    rule(r"Rank \d+ scheduler is dead|scheduler died during initialization", "other", True),
    rule(r"Subprocess \S+ \(pid=\d+\) crashed with exit code", "other", True),
    rule(r"Received sigquit from a child process|SIGQUIT received\.", "other", True),
    rule(r"Initialization failed\. warmup error", "other", True),
    rule(r"Capture cuda graph failed", "other", True),
    rule(r"Exception in (?:run_tp_server|ModelTpServer|ControllerSingle|run_data_parallel_controller)", "other",
         True),  # before 0.4
    rule(r"Not enough memory\. Please try to increase --mem-fraction-static|Prefill out of memory"
         r"|Decode out of memory", "cuda_oom", False),
]

_LOADING = re.compile(r"Load weight begin\.|Init torch distributed begin")
# Decode graphs, then with piecewise graphs their own begin line and the token sizes they capture.
_CAPTURING = re.compile(r"Capture (?:[\w ]+ )?cuda graph (?:begin|bs |num tokens)", re.IGNORECASE)
_READY = re.compile(r"The server is fired up and ready to roll!")
_DECODE = re.compile(r"Decode batch(?: \[\d+\])?[.,] ")

_NUM = r"(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
_DECODE_FIELDS = [
    # A following ',' proves the number was printed whole (a log cut mid-line ends in a partial one).
    ("accept_len", re.compile(r", accept len: " + _NUM + ",")),
    ("accept_rate", re.compile(r", accept rate: " + _NUM + ",")),
    ("gen_throughput", re.compile(r"gen throughput \(token/s\): " + _NUM + ",")),
]
_LOAD_END = re.compile(r"Load weight end\. elapsed=" + _NUM + " s")
# bench_serving rows '{label:<40} {value:<10}'; anchored so 'Peak output token throughput' is not taken.
_BENCH = re.compile(
    r"^(Request throughput \(req/s\)|Output token throughput \(tok/s\)|Total token throughput \(tok/s\)"
    r"|Median TTFT \(ms\)|Median ITL \(ms\)|Accept length):\s+" + _NUM + r"\s*$"
)
_BENCH_NAMES = {
    "Request throughput (req/s)": "request_throughput",
    "Output token throughput (tok/s)": "output_throughput",
    "Total token throughput (tok/s)": "total_token_throughput",
    "Median TTFT (ms)": "median_ttft_ms",
    "Median ITL (ms)": "median_itl_ms",
    "Accept length": "accept_len",
}


def metrics(text: str) -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    if "Decode batch" in text and _DECODE.search(text):
        for name, pattern in _DECODE_FIELDS:
            m = pattern.search(text)
            if m:
                found.append((name, float(m.group(1))))
    elif "Load weight end" in text:
        m = _LOAD_END.search(text)
        if m:
            found.append(("load_weight_s", float(m.group(1))))
    elif "):" in text or "Accept length:" in text:
        m = _BENCH.match(text)
        if m:
            found.append((_BENCH_NAMES[m.group(1)], float(m.group(2))))
    return found


def line_phase(text: str, phase: str = "starting") -> str | None:
    if "Decode batch" in text and _DECODE.search(text):
        return "running"
    if phase == "starting" and "Prefill batch" in text:
        return "running"  # a log that begins while it serves (a warm-up prefill comes after the load)
    if _READY.search(text):
        return "ready"
    if _LOADING.search(text):
        return "loading"
    if "raph " in text and _CAPTURING.search(text):
        return "capturing"
    return None


def bar_phase(label: str) -> str | None:
    # Only weight loading and graph capture have bars in a server log; others say nothing of the phase.
    return None
