"""SGLang (0.4.10 to 0.5.23): its server's lines, from the format strings of each version.

Sources are paths under `python/sglang/` (the wheel's `sglang/`). Versions: 0.4.10 = 0.4.10.post2,
0.5.5 = 0.5.5.post3. bench_serving's result block is read by bench.py.

Acceptance in the decode line means different things by version, so besides `accept_rate` as printed it is
recorded under a name that says what was divided by what:
  - 0.5.5 (the line ends in '#queue-req: N, '): accepted tokens, the bonus token included, per draft-token
    slot verified (`speculative_num_draft_tokens` per step) -> `accept_per_draft_slot`;
  - 0.5.23 (no trailing comma): drafted tokens accepted per token drafted (draft tokens - 1 per step), the
    bonus token left out -> `draft_accept_rate`, which is what vLLM's acceptance rate means too;
  - 0.4.10 prints no rate. `accept_len` is accepted tokens per verify step, the bonus token included, in
    every version.
"""

from __future__ import annotations

import re

from .errors import Rule, rule
from .formats import NUM, Format, Screen, line, metrics_of, phase_of

KNOWN = ("0.4.10", "0.5.23")  # the versions whose sources these tables were taken from

# What only SGLang prints (its '[time TPn]' prefix is recognised where lines are cleaned); its capture bars
# alone name it too. Each branch holds one of the screen's words.
DETECT = Screen(re.compile(
    r"sglang|The server is fired up|Load weight (?:begin|end)\.|Decode batch[ .,\[]|Prefill batch[ .,\[]"
    r"|server_args=ServerArgs\(|Capture (?:[\w ]+ )?cuda graph (?:begin|end|bs|num tokens)"
    r"|KV Cache is allocated|Memory pool end\.|Init torch distributed (?:begin|ends)|Scheduler hit an exception"
    r"|^Capturing batches \(bs=\d+ avail_mem=|^(?:Compiling|Capturing) num tokens \(num_tokens=",
    re.IGNORECASE,
), ("sglang", "fired up", "load weight", "decode batch", "prefill batch", "serverargs", "graph",
    "is allocated", "memory pool end", "init torch distributed", "hit an exception", "capturing batches",
    "num tokens"))

_RUNNER = "srt/model_executor/model_runner.py"
_GRAPHS = "srt/model_executor/cuda_graph_runner.py"
_SCHED = "srt/managers/scheduler.py"

RULES: list[Rule] = [
    # The process hit an exception: its traceback follows on the same line and may be cut.
    rule(r"(?:Scheduler|DetokenizerManager|TokenizerManager|DataParallelController|Multi\w*Router)"
         r" hit an exception", "python_exception", True, versions="0.4.10-0.5.23", source=_SCHED),
    rule(r"Rank \d+ scheduler is dead", "other", True, versions="0.4.10-0.5.5",
         source="srt/entrypoints/engine.py"),
    rule(r"scheduler died during initialization", "other", True, versions="0.5.23",
         source="srt/entrypoints/engine.py"),
    rule(r"Subprocess \S+ \(pid=\d+\) crashed with exit code", "other", True, versions="0.5.23",
         source="srt/utils/watchdog.py"),
    rule(r"Received sigquit from a child process|SIGQUIT received\.", "other", True, versions="0.4.10-0.5.23",
         source="srt/entrypoints/engine.py"),
    rule(r"Initialization failed\. warmup error", "other", True, versions="0.4.10-0.5.23",
         source="srt/entrypoints/http_server.py"),
    # Decode graphs ('cuda graph'), 0.5.23's prefill graphs, CPU graphs (0.5.5+), the MTP variants.
    rule(r"Capture (?:[\w -]+ )?(?:cuda|CUDA|CPU|cpu) graph failed", "other", True, versions="0.4.10-0.5.23",
         source=_GRAPHS),
    rule(r"Exception in (?:run_tp_server|ModelTpServer|ControllerSingle|run_data_parallel_controller)", "other",
         True, versions="<0.4"),
    # The scheduler made no progress for --watchdog-timeout: it dumps its stacks (py-spy) and SIGQUITs the
    # server; a soft watchdog (soft=True) only dumps.
    rule(r"[Ww]atchdog timeout \((?:self\.)?watchdog_timeout=[\d.]+(?:, (?:self\.)?soft=False)?\)", "timeout", True,
         versions="0.4.10-0.5.23", source="srt/utils/watchdog.py"),
    rule(r"Not enough memory\. Please try to increase --mem-fraction-static", "cuda_oom", False,
         versions="0.4.10-0.5.23", source=_RUNNER),
    rule(r"Prefill out of memory|Decode out of memory", "cuda_oom", False, versions="0.4.10-0.5.23",
         source="srt/managers/schedule_policy.py"),
]

# A stop was asked for: the server drains its requests and exits (0.5+; 'Gracefully exiting' as it goes).
SHUTDOWN = re.compile(r"SIGTERM received\. .*shutting down|Gracefully exiting\.\.\.")

_CAPTURE = r"Capture (?:[\w ]+ )?cuda graph "
_DECODE = r"Decode batch(?: \[\d+\])?[.,] "
_MIXIN = "srt/managers/scheduler_metrics_mixin.py"
FORMATS: list[Format] = [
    line(_DECODE, "running", "0.4.10-0.5.23", _MIXIN, "Decode batch"),
    line(r"The server is fired up and ready to roll!", "ready", "0.4.10-0.5.23",
         "srt/entrypoints/http_server.py",
         "fired up"),
    line(r"Init torch distributed begin\.", "loading", "0.4.10-0.5.23", _RUNNER, "Init torch"),
    line(r"Load weight begin\. avail mem=", "loading", "0.4.10-0.5.23", _RUNNER, "Load weight begin"),
    # 'Load weight end. type=...' (0.4.10, 0.5.5), '... elapsed=...' (0.5.23), and 0.5.23's deferred load:
    # 'Load weight end. Committed real weights after CUDA graph capture in ...'.
    line(r"Load weight end\. (?:type=|elapsed=|Committed real weights)", "loading", "0.4.10-0.5.23", _RUNNER,
         "Load weight end"),
    line(r"(?:KV Cache|\w[\w ]*) is allocated\. (?:#tokens|dtype): ", "loading", "0.4.10-0.5.23",
         "srt/mem_cache/memory_pool.py", "is allocated"),
    line(r"Memory pool end\. avail mem=", "loading", "0.4.10-0.5.23", _RUNNER, "Memory pool end"),
    # Graphs done, or weights, KV cache and graphs of the draft to come: the server is still starting.
    line(_CAPTURE + r"end\.", "loading", "0.4.10-0.5.23", _GRAPHS, "raph end", flags=re.IGNORECASE),
    # 'Capture cuda graph begin.' (0.4.10, 0.5.5), 'Capture target decode CUDA graph begin.' (0.5.23), and the
    # piecewise graphs' own lines ('Capture cuda graph bs [...]', '... num tokens [...]', 0.5.5).
    line(_CAPTURE + r"(?:begin|bs |num tokens)", "capturing", "0.4.10-0.5.23", _GRAPHS, "raph ",
         flags=re.IGNORECASE),
    line(r"Decode batch(?: \[\d+\])?[.,] .*, accept len: " + NUM + ",", "metric", "0.4.10-0.5.23",
         _MIXIN, "accept len", ["accept_len"]),
    # A following ',' proves a number was printed whole (a log cut mid-line ends in a partial one).
    line(r"Decode batch(?: \[\d+\])?[.,] .*, accept rate: " + NUM + ",", "metric", "0.5.5-0.5.23",
         _MIXIN, "accept rate", ["accept_rate"]),
    line(_DECODE + r".*, accept rate: " + NUM + r",.*#queue-req: \d+,\s*$", "metric", "0.5.5", _MIXIN,
         "accept rate", ["accept_per_draft_slot"]),
    line(_DECODE + r".*, accept rate: " + NUM + r",.*#queue-req: \d+(?:\s*$|, est\. )", "metric", "0.5.23",
         "srt/managers/scheduler_components/metrics_reporter.py", "accept rate", ["draft_accept_rate"]),
    line(_DECODE + r".*gen throughput \(token/s\): " + NUM + ",", "metric", "0.4.10-0.5.23", _MIXIN,
         "gen throughput", ["gen_throughput"]),
    line(r"Load weight end\. elapsed=" + NUM + " s", "metric", "0.5.23", _RUNNER, "elapsed=",
         ["load_weight_s"]),
    line(r"Load weight end\. Committed real weights after CUDA graph capture in " + NUM + " s", "metric",
         "0.5.23", "srt/model_loader/startup_weight_load.py", "Committed real", ["weight_commit_s"]),
]

_LOAD_BEGIN = re.compile(r"Load weight begin\. avail mem=")
_LOAD_END = re.compile(r"Load weight end\. ")


# 0.5.9 and 0.5.10 dropped the decode line's trailing comma but kept the old rate (per draft-token slot);
# 0.5.11 changed it to drafted tokens accepted per token drafted. Only the version tells those apart.
_RATE_PER_DRAFTED_SINCE = (0, 5, 11)


def metrics(text: str, version: tuple[int, ...] = ()) -> list[tuple[str, float]]:
    """The numbers of a line; `version` (the installed SGLang's release, when known) names the decode line's
    acceptance rate where its layout does not tell (0.5.9, 0.5.10)."""
    found = metrics_of(FORMATS, text)
    if version and version < _RATE_PER_DRAFTED_SINCE:
        found = [("accept_per_draft_slot" if name == "draft_accept_rate" else name, value) for name, value in found]
    return found


def load_mark(text: str) -> str | None:
    """'begin' or 'end' of a weight load: the times of the two lines give its length where the end line
    does not (0.4.10 and 0.5.5 print no elapsed time)."""
    if "Load weight" not in text:
        return None
    if _LOAD_BEGIN.search(text):
        return "begin"
    if _LOAD_END.search(text) and "elapsed=" not in text:
        return "end"
    return None


def line_phase(text: str, phase: str = "starting") -> str | None:
    if phase == "starting" and "Prefill batch" in text:
        return "running"  # a log that begins while it serves (a warm-up prefill comes after the load)
    return phase_of(FORMATS, text)


def bar_phase(label: str) -> str | None:
    # Only weight loading and graph capture have bars in a server log; others say nothing of the phase.
    return None
