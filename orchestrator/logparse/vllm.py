"""vLLM (0.6 to 0.33) server and offline logs, from the format strings of each version.

Sources are paths under `vllm/`. `vllm bench serve`'s result block is read by bench.py.

Speculative decoding: `SpecDecoding metrics: ... Avg Draft acceptance rate: R%` is accepted draft tokens per
drafted token, the bonus token left out: recorded as `accept_rate` (a fraction, as orch always recorded it)
and as `draft_accept_rate`, the name it shares with SGLang 0.5.23's rate of the same meaning. `Mean
acceptance length` (`accept_len`) counts the bonus token; `Per-position acceptance rate: a, b, ...` gives
`accept_rate_pos_0`, `accept_rate_pos_1`, ...
"""

from __future__ import annotations

import re

from .errors import Rule, rule
from .formats import Format, line, metrics_of, phase_of

KNOWN = ("0.6", "0.33")  # the versions whose sources these tables were taken from

# Its process prefixes and its logging layout (old and new) are recognised where lines are cleaned.
DETECT = re.compile(r"vllm|vLLM|EngineCore|\((?:APIServer|Worker_\w+|VllmWorker\S*) pid="
                    # its own bars and compile lines, which a log of nothing else still shows
                    r"|^Capturing CUDA graphs \((?:mixed prefill-decode|decode|prefill)[,)]"
                    r"|^(?:Processed prompts|Adding requests): |Dynamo bytecode transform time: ")

_CORE = "v1/engine/core.py"
_CLIENT = "v1/engine/core_client.py"
_EXECUTOR = "v1/executor/multiproc_executor.py"
_WORKER_UTILS = "v1/worker/utils.py"

RULES: list[Rule] = [
    rule(r"EngineCore failed to start|WorkerProc failed to start", "other", True, versions="0.8-0.33",
         source=_CORE),
    rule(r"Engine core initialization failed|Engine process failed to start", "other", True,
         versions="0.8-0.33", source="v1/engine/utils.py"),
    # The engine hit an exception (its traceback is above or follows).
    rule(r"EngineCore encountered a fatal error|WorkerProc hit an exception|EngineCore encountered an issue",
         "python_exception", True, versions="0.8-0.33", source=_CORE),
    rule(r"Engine background task failed|\bAsyncEngineDeadError\b|\bEngineDeadError\b", "other", True,
         versions="0.6-0.33", source="v1/engine/exceptions.py"),
    rule(r"Worker proc \S+ died unexpectedly", "other", True, versions="0.8-0.33", source=_EXECUTOR),
    rule(r"Engine core proc \S+ died unexpectedly", "other", True, versions="0.8-0.16", source=_CLIENT),
    # The engine core process is gone (0.32+ say so at WARNING only): killed, when it left no word of its own
    # before (SIGKILL: the OOM killer, a person), and the EngineDeadError tracebacks after it hold no other
    # cause; after its own fatal error, only how that error ended (it names no cause: it renames none).
    rule(r"engine core exited unexpectedly", "killed", True, versions="0.32-0.33", source=_CLIENT,
         any_level=True),
    rule(r"RayWorkerProc rank=\d+ died unexpectedly", "other", True, versions="0.33",
         source="v1/executor/ray_executor_v2.py"),
    rule(r"No available memory for the cache blocks", "cuda_oom", True, versions="0.6-0.33",
         source="v1/core/kv_cache_utils.py"),
    # Startup refusals: less free memory than --gpu-memory-utilization asks for (0.33 adds a second one for
    # memory that other processes' weights hold).
    rule(r"Free memory on device .{0,200}? is less than"
         r" (?:desired GPU memory utilization|the engine's budget)"
         r"|Externally held weights on device .{0,200}? exceed the desired GPU memory utilization",
         "cuda_oom", True, versions="0.8-0.33", source=_WORKER_UTILS),
    rule(r"Failed to load model - not enough GPU memory", "cuda_oom", True, versions="0.33",
         source="v1/worker/gpu_model_runner.py"),
]

_RUNNER = "v1/worker/gpu_model_runner.py"
FORMATS: list[Format] = [
    line(r"Application startup complete", "ready", "all", "(uvicorn)", "startup complete"),
    line(r"Starting to load model", "loading", "0.6-0.33", _RUNNER, "Starting to load"),
    line(r"Loading weights took|Loading model weights took", "loading", "0.6-0.33",
         "model_executor/model_loader/default_loader.py", "weights took"),
    line(r"Model loading took", "loading", "0.6-0.33", _RUNNER, "Model loading took"),
    line(r"Initializing an? (?:V1 )?LLM engine", "loading", "0.6-0.33", "engine/llm_engine.py", "LLM engine"),
    line(r"Available KV cache memory: ", "loading", "0.8-0.33", "v1/worker/gpu_worker.py", "KV cache memory"),
    line(r"(?:GPU|CPU) KV cache size: ", "loading", "0.8-0.33", "v1/core/kv_cache_utils.py", "KV cache size"),
    # Graphs are done and the engine is initialised: the API server is still to start, so it is loading.
    line(r"Graph capturing finished in ", "loading", "0.6-0.33", _RUNNER, "Graph capturing finished"),
    line(r"init engine \(profile, create kv cache, warmup model\) took", "loading", "0.8-0.33", _CORE,
         "init engine"),
    line(r"Starting vLLM (?:API )?server", "loading", "0.11-0.33", "entrypoints/openai/api_server.py",
         "Starting vLLM"),
    line(r"Capturing CUDA graphs?|Capturing cudagraphs?|Capturing the model for CUDA graphs", "capturing",
         "0.6-0.33", _RUNNER, "Capturing"),
    line(r"Loading weights took (\d+(?:\.\d+)?) seconds", "metric", "0.6-0.33",
         "model_executor/model_loader/default_loader.py", "Loading weights took", ["load_weight_s"]),
    # The rate is printed last: without it the line was cut, and its other numbers may be too.
    line(r"Mean acceptance length:\s+(\d+(?:\.\d+)?),.*Draft acceptance rate:\s+(\d+(?:\.\d+)?)%", "metric",
         "0.8-0.33", "v1/spec_decode/metrics.py", "SpecDecoding metrics",
         ["accept_len", ("accept_rate", 2, 0.01), ("draft_accept_rate", 2, 0.01)]),
    line(r"Speculative metrics: Draft acceptance rate:\s+(\d+(?:\.\d+)?),", "metric", "0.6",
         "spec_decode/metrics.py", "Speculative metrics", ["accept_rate", ("draft_accept_rate", 1, 1.0)]),
]

_NUM = r"(\d+(?:\.\d+)?)"
# Pasted logs sometimes widen the spaces; ' tokens/s' after the number proves it was printed whole.
_THROUGHPUT = re.compile(r"Avg\s+prompt\s+throughput:\s+" + _NUM
                         + r"\s+tokens/s,\s+Avg\s+generation\s+throughput:\s+" + _NUM + r"\s+tokens/s")
_PER_POSITION = re.compile(r"Per-position acceptance rate: ((?:\d+(?:\.\d+)?, )*\d+(?:\.\d+)?),")
_RUNNING_BARS = re.compile(r"^(?:Processed prompts|Adding requests)")


def metrics(text: str) -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    if "throughput:" in text:
        m = _THROUGHPUT.search(text)
        if m:
            found.append(("gen_throughput", float(m.group(2))))
    found += metrics_of(FORMATS, text)
    if "Per-position acceptance rate" in text and found:  # only a line whose rate was printed whole
        m = _PER_POSITION.search(text)
        if m:
            found += [(f"accept_rate_pos_{i}", float(v)) for i, v in enumerate(m.group(1).split(", "))]
    return found


def serving(text: str) -> bool:
    """A stats line that shows requests being served (vLLM logs zero rates only at debug level)."""
    m = _THROUGHPUT.search(text) if "throughput:" in text else None
    return bool(m and (float(m.group(1)) > 0 or float(m.group(2)) > 0))


def line_phase(text: str, phase: str = "starting") -> str | None:
    if serving(text):
        return "running"
    return phase_of(FORMATS, text)


def bar_phase(label: str) -> str | None:
    return "running" if _RUNNING_BARS.match(label) else None


# A stop was asked for (SIGTERM, SIGINT): the API server's own word (0.32+). What the engine prints after it
# (an output handler that fails on the engine it is shutting down, 'EngineDeadError') is the stop, not a cause.
SHUTDOWN = re.compile(r"\[shutdown\] API server: shutdown triggered")
# The CPU backend: its KV cache lines, its platform, its worker and runner files.
# (Not 'on the CPU backend' alone: the KV cache refusal says that on any device.)
_CPU = re.compile(r"CPU KV cache (?:size|usage)|detected platform cpu\b|\[cpu(?:_worker|_model_runner)?\.py:\d+\]"
                  r"|On the CPU backend, the --gpu-memory-utilization")
CORE_EXITED = "engine core exited unexpectedly"
# What every process that used a dead engine core raises: the consequence of its death, never its cause.
DEAD = re.compile(r"(?:^|\.)(?:Async)?EngineDeadError$")
_URL = re.compile(r"Starting vLLM (?:API )?server(?: \d+)? on (https?://[^\s,]+)")
# One model load: the first weights loaded after it began are the target's; a draft (EAGLE-3, MTP) or the
# hidden-states extractor loads after it in the same process and prints its own 'Loading weights took'.
LOAD_BEGIN = "Starting to load model"
LOAD_END = re.compile(r"Loading (?:model )?weights took")


def on_cpu(raw: str) -> bool:
    """A line only vLLM's CPU backend prints."""
    return "cpu" in raw.lower() and bool(_CPU.search(raw))


# The version it prints as it starts: the engine's config line (0.8+), the API server's (0.6-0.7), the banner.
_VERSION = re.compile(r"Initializing an? (?:V1 )?LLM engine \(v(\d+\.\d+[\w.+-]*)\)"
                      r"|vLLM API server version (\d+\.\d+[\w.+-]*)|█ +version (\d+\.\d+[\w.+-]*)")


def version_of(text: str) -> str | None:
    """The vLLM version a line says is running."""
    if "version" not in text and "LLM engine (v" not in text:
        return None
    m = _VERSION.search(text)
    return next((g for g in m.groups() if g), None) if m else None


def url_of(text: str) -> str | None:
    """The address the API server says it serves on."""
    if "Starting vLLM" not in text:
        return None
    m = _URL.search(text)
    return m.group(1).rstrip(".") if m else None
