"""The log lines worth waking a held poll for: what ends a run, readies a server or changes its phase.

One regular expression, looked for by the host's agent in the new bytes five times a second while it holds
a poll. Progress bars and decode statistics are left out on purpose: they come all the time, and the
backoff reads them soon enough. A false wake costs one round trip; a missed one, the rest of the hold.
"""

from __future__ import annotations

_PARTS = (
    r"Traceback \(most recent call last\)",
    r"[A-Za-z]+(Error|Exception)(:|$)",  # an exception line, whatever prefix it carries
    r"NCCL (error|WARN)|CUDA error|[Oo]ut of memory|Killed",
    r"died|is dead|crashed|Aborting|[Ff]atal|failed to start|hit an exception",
    r"fired up and ready|Application startup complete|Uvicorn running on",
    r"Load weight (begin|end)|[Cc]apture .*cuda graph (begin|end)|Starting vLLM",
    r"Serving Benchmark Result|orch-metric ",
)
WAKE = "|".join(_PARTS)
