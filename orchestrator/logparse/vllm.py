"""vLLM (0.11 to 0.33) server and offline logs."""

from __future__ import annotations

import re

from .errors import Rule, rule

NAME = "vllm"

DETECT = re.compile(r"vllm|vLLM|EngineCore|\((?:APIServer|Worker_\w+|VllmWorker\S*) pid=")

RULES: list[Rule] = [
    rule(r"EngineCore failed to start|EngineCore encountered a fatal error|WorkerProc failed to start"
         r"|Engine core initialization failed", "exception", True),
    rule(r"Worker proc \S+ died unexpectedly", "scheduler_died", True),
    rule(r"No available memory for the cache blocks"
         r"|Free memory on device .{0,200}? is less than desired GPU memory utilization", "cuda_oom", False),
]

_LOADING = re.compile(r"Starting to load model|Loading weights took|Loading model weights took")
_CAPTURING = re.compile(r"Capturing CUDA graphs?|Capturing cudagraphs?")
_READY = re.compile(r"Starting vLLM API server|Starting vLLM server on|Application startup complete")
_NUM = r"(\d+(?:\.\d+)?)"
_THROUGHPUT = re.compile(r"Avg prompt throughput: " + _NUM + r" tokens/s, Avg generation throughput: " + _NUM)
_MEAN_ACCEPT = re.compile(r"Mean acceptance length: " + _NUM)
_ACCEPT_RATE = re.compile(r"Draft acceptance rate: " + _NUM + "%")
_LOAD_TOOK = re.compile(r"Loading weights took " + _NUM + " seconds")
_RUNNING_BARS = re.compile(r"^(?:Processed prompts|Adding requests)")


def metrics(text: str) -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    if "Avg generation throughput" in text:
        m = _THROUGHPUT.search(text)
        if m:
            found.append(("gen_throughput", float(m.group(2))))
    if "SpecDecoding metrics" in text:
        m = _MEAN_ACCEPT.search(text)
        if m:
            found.append(("accept_len", float(m.group(1))))
        m = _ACCEPT_RATE.search(text)
        if m:
            found.append(("accept_rate", float(m.group(1)) / 100))
    if "Loading weights took" in text:
        m = _LOAD_TOOK.search(text)
        if m:
            found.append(("load_weight_s", float(m.group(1))))
    return found


def serving(text: str) -> bool:
    """A stats line that shows requests being served (vLLM logs zero rates only at debug level)."""
    m = _THROUGHPUT.search(text) if "Avg generation throughput" in text else None
    return bool(m and (float(m.group(1)) > 0 or float(m.group(2)) > 0))


def line_phase(text: str) -> str | None:
    if serving(text):
        return "running"
    if _READY.search(text):
        return "ready"
    if _LOADING.search(text):
        return "loading"
    if _CAPTURING.search(text):
        return "capturing"
    return None


def bar_phase(label: str) -> str | None:
    return "running" if _RUNNING_BARS.match(label) else None
