"""Understanding inference-engine logs: bytes in; engine, phase, progress, error and metrics out.

Pure and standard-library only: nothing here knows about hosts, runs or the database.

Lines are read whatever their prefixes (peeled in any nesting): vLLM's process prefixes ('(APIServer
pid=N)', '(EngineCore_DP0 pid=N)', '(Worker_TP7_EP7 pid=N)', '(VllmWorker rank=0 pid=N)') and its
logging layouts old and new ('INFO 11-20 12:00:00 model_runner.py:680]', '... [file.py:12]'), SGLang's
'[time DPn TPn]', '[rank3]: ', c10d's '[E626 ...]', Python logging's '... - name - LEVEL - ', a
collector's time or unit, colour codes; Rich's wrapped columns are joined back into lines.

Error kinds (errors.KINDS): other, python_exception, import_error, timeout, config_error, killed, nccl,
cuda_oom; the most specific symptom of a failure names it. The exception class and message come from the
exception line itself (a traceback's last line, or 'XxxError: ...' logged at ERROR level), never from a
source line a frame quotes; a chained traceback keeps its root cause, later exceptions go to `chain`.

Fatal: the run cannot recover even while its processes linger (the other ranks of a TP job hang holding
every GPU), so a fatal error fails the run and stops its process group at once:
  - an NCCL error or watchdog timeout on any rank (DistBackendError, 'NCCL error', ncclSystemError, ...);
  - a CUDA error other than an out-of-memory ('CUDA error: ...', CUBLAS/CUDNN status, illegal memory
    access, device-side assert), or a crash below Python (segfault, 'Fatal Python error', C++ abort);
  - an uncaught traceback: its outermost frame is a script's '<module>' (or `python -m`'s runner), so the
    interpreter exits; logged at WARNING or DEBUG it is not one;
  - an engine's own line that it failed to start, died or hit an exception: SGLang 'Scheduler hit an
    exception', 'scheduler is dead', 'Received sigquit', 'warmup error', 'Capture cuda graph failed'; vLLM
    'EngineCore failed to start', 'Engine core initialization failed', 'Engine core proc ... died
    unexpectedly', 'Worker proc ... died unexpectedly', 'RayWorkerProc rank=N died unexpectedly',
    'Engine background task failed'; speculators 'Data generation failed', 'Aborting: N consecutive
    samples errored out'; torchrun's ChildFailedError; vLLM's refusal of a max model length its KV cache
    cannot hold;
  - SIGKILL: a shell's 'Killed', an exit code -9, the kernel's OOM killer. 'Killed' names the kind only
    with no exception before it, and the OOM killer only when the log shows it (oom-kill, exit code -9).
Anything else (a traceback a process caught and logged, a CUDA out-of-memory the engine may retry) is
tentative: the exit code or the pid decides, and healthy work after it (a bar that moves on, decode
statistics, the ready line, metrics) clears it. Lines logged at DEBUG/INFO/WARNING, Python warnings,
NCCL's debug output and SGLang's 'Ignore import error' are never errors by their words alone.

Metrics: the engines' own statistics, and any job's `orch-metric NAME=VALUE ...` lines (see protocol.py);
each sample carries the line's own time as printed, when it shows one (stamp_time reads it).
"""

from __future__ import annotations

import os
from typing import Any

from .errors import KINDS, LogError
from .parser import PHASES, LogParser, Metric
from .protocol import protocol_metrics
from .text import stamp_time
from .tqdm import Progress, parse_bar

__all__ = ["KINDS", "PHASES", "LogError", "LogParser", "Metric", "Progress", "inspect_file", "parse_bar",
           "protocol_metrics", "stamp_time"]


def inspect_file(path: str | os.PathLike[str], chunk_size: int = 1 << 20) -> dict[str, Any]:
    """Summary of a whole log file, read in chunks so any size fits in bounded memory."""
    parser = LogParser()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            parser.feed(chunk)
    parser.finish()
    err = parser.error
    return {
        "engine": parser.engine,
        "phase": parser.phase,
        "progress": parser.progress.to_dict() if parser.progress else None,
        "error": (
            {"kind": err.kind, "exception": err.exception, "message": err.message, "line": err.line,
             "fatal": err.fatal, "chain": list(err.chain)}
            if err else None
        ),
        "metrics": dict(parser.metrics),
    }
