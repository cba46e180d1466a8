"""vLLM (0.11 to 0.33) server and offline logs."""

from __future__ import annotations

import re

from .errors import Rule, rule

NAME = "vllm"

# Its process prefixes and its logging layout (old and new) are recognised where lines are cleaned.
DETECT = re.compile(r"vllm|vLLM|EngineCore|\((?:APIServer|Worker_\w+|VllmWorker\S*) pid=")

RULES: list[Rule] = [
    rule(r"EngineCore failed to start|EngineCore encountered a fatal error|WorkerProc failed to start"
         r"|Engine core initialization failed|Engine process failed to start", "other", True),
    rule(r"Engine background task failed|\bAsyncEngineDeadError\b|\bEngineDeadError\b|WorkerProc hit an exception",
         "other", True),
    rule(r"Worker proc \S+ died unexpectedly|Engine core proc \S+ died unexpectedly"
         r"|RayWorkerProc rank=\d+ died unexpectedly", "other", True),
    rule(r"No available memory for the cache blocks"
         r"|Free memory on device .{0,200}? is less than desired GPU memory utilization", "cuda_oom", True),
]

_LOADING = re.compile(r"Starting to load model|Loading weights took|Loading model weights took|Model loading took"
                      r"|Initializing an? (?:V1 )?LLM engine")
_CAPTURING = re.compile(r"Capturing CUDA graphs?|Capturing cudagraphs?|Capturing the model for CUDA graphs")
# 'Starting vLLM (API) server' comes before uvicorn serves: only uvicorn's line says it does.
_READY = re.compile(r"Application startup complete")
_NUM = r"(\d+(?:\.\d+)?)"
# Pasted logs sometimes widen the spaces; ' tokens/s' after the number proves it was printed whole.
_THROUGHPUT = re.compile(r"Avg\s+prompt\s+throughput:\s+" + _NUM + r"\s+tokens/s,\s+Avg\s+generation\s+throughput:\s+"
                         + _NUM + r"\s+tokens/s")
_MEAN_ACCEPT = re.compile(r"Mean acceptance length:\s+" + _NUM)
_ACCEPT_RATE = re.compile(r"Draft acceptance rate:\s+" + _NUM + "%")
_ACCEPT_FRACTION = re.compile(r"Speculative metrics: Draft acceptance rate:\s+" + _NUM + ",")  # 0.6: 0.607
_LOAD_TOOK = re.compile(r"Loading weights took " + _NUM + " seconds")
_RUNNING_BARS = re.compile(r"^(?:Processed prompts|Adding requests)")


def metrics(text: str) -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    if "throughput:" in text:
        m = _THROUGHPUT.search(text)
        if m:
            found.append(("gen_throughput", float(m.group(2))))
    if "SpecDecoding metrics" in text:
        # The rate is printed last: without it the line was cut, and its other numbers may be too.
        rate = _ACCEPT_RATE.search(text)
        if rate:
            m = _MEAN_ACCEPT.search(text)
            if m:
                found.append(("accept_len", float(m.group(1))))
            found.append(("accept_rate", float(rate.group(1)) / 100))
    elif "Speculative metrics" in text:
        m = _ACCEPT_FRACTION.search(text)
        if m:
            found.append(("accept_rate", float(m.group(1))))
    if "Loading weights took" in text:
        m = _LOAD_TOOK.search(text)
        if m:
            found.append(("load_weight_s", float(m.group(1))))
    return found


def serving(text: str) -> bool:
    """A stats line that shows requests being served (vLLM logs zero rates only at debug level)."""
    m = _THROUGHPUT.search(text) if "throughput:" in text else None
    return bool(m and (float(m.group(1)) > 0 or float(m.group(2)) > 0))


def line_phase(text: str, phase: str = "starting") -> str | None:
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
