"""Understanding inference-engine logs: bytes in; engine, phase, progress, error and metrics out.

Pure and standard-library only: nothing here knows about hosts, runs or the database.

Lines are read whatever their prefixes (peeled in any nesting): vLLM's process prefixes ('(APIServer
pid=N)', '(EngineCore_DP0 pid=N)', '(Worker_TP7_EP7 pid=N)', '(VllmWorker rank=0 pid=N)') and its
logging layouts old and new ('INFO 11-20 12:00:00 model_runner.py:680]', '... [file.py:12]'), SGLang's
'[time DPn TPn]', '[rank3]: ', c10d's '[E626 ...]', Python logging's '... - name - LEVEL - ', a
collector's time or unit, colour codes; Rich's wrapped columns are joined back into lines.

Error kinds (errors.KINDS): other, python_exception, import_error, timeout, config_error, killed, nccl,
cuda_oom; the most specific symptom of a failure names it, and a root cause stays the error when other
ranks' noise or a 'Killed' follows it. The exception class and message come from the
exception line itself (a traceback's last line, or 'XxxError: ...' logged at ERROR level), never from a
source line a frame quotes; a chained traceback keeps its root cause, later exceptions go to `chain`.

Fatal: the run cannot recover even while its processes linger (the other ranks of a TP job hang holding
every GPU), so a fatal error fails the run and stops its process group at once:
  - an NCCL error or watchdog timeout on any rank (DistBackendError, 'NCCL error', ncclSystemError, ...);
  - a CUDA error other than an out-of-memory ('CUDA error: ...', CUBLAS/CUDNN status, illegal memory
    access, device-side assert), or a crash below Python (segfault, 'Fatal Python error', C++ abort);
  - an uncaught traceback: its outermost frame is a script's '<module>', `python -m`'s runner or a
    multiprocessing child's top level, so the process exits; logged at WARNING or DEBUG it is not one;
  - an engine's own line that it failed to start, died or hit an exception (the tables of the engine
    modules: SGLang's 'Scheduler hit an exception', vLLM's 'EngineCore failed to start', speculators'
    'Aborting: N consecutive samples errored out', ...); torchrun's ChildFailedError; vLLM's refusal of a
    max model length its KV cache cannot hold;
  - the scheduler's end of the job: Slurm's 'CANCELLED ... DUE TO TIME LIMIT' (timeout), other
    cancellations, 'srun: error: node: task N: Killed', 'srun: Job step aborted' (killed);
  - SIGKILL: a shell's 'Killed', an exit code -9, the kernel's OOM killer. 'Killed' names the kind only
    with no exception before it, and the OOM killer only when the log shows it (oom-kill, exit code -9).
Anything else is tentative, and what follows decides (Fatal or survivable):
  - healthy work after it (a bar that moves on, decode statistics, a request answered 200, the ready line,
    a trainer's step metrics) shows the process survived it: a bad request's traceback on a server that
    keeps answering, a CUDA out-of-memory the engine retried;
  - the exit code or the pid, where the watcher knows them;
  - the end of the log: a traceback cut short before its exception line (a clipped pane, a rank stopped
    mid-frame), an exception line or an engine's warning of trouble that nothing healthy followed is how
    the run ended; a complete traceback that something caught is survived.
A traceback cut short is a python_exception, of the class a frame's `raise` names when one does. Lines
logged at DEBUG/INFO/WARNING, Python warnings, NCCL's debug output, a file lock's debug lines and SGLang's
'Ignore import error' are never errors by their words alone (except markers that count at any level, such
as vLLM 0.33's WARNING that an engine core exited). Each error carries a hint (hints.py): a remedy and
where the advice comes from.

Engines, trainers and tools are read from tables (formats.py; sglang.py, vllm.py, speculators.py,
slurm.py), and what no table knows by its shape: any traceback, any tqdm bar and its postfix metrics, a
trainer's dict or step lines (trainers.py), a benchmark's result block (bench.py), exit words.

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
             "fatal": err.fatal, "chain": list(err.chain), "hint": err.hint}
            if err else None
        ),
        "metrics": dict(parser.metrics),
    }
