"""Understanding inference-engine logs: bytes in; engine, phase, progress, error and metrics out.

Pure and standard-library only: nothing here knows about hosts, runs or the database.

Lines are read whatever their prefixes, recognised by shape and peeled in any nesting (text.py): a process
tag in parentheses with a pid or rank ('(EngineCore_DP0 pid=N)', '(VllmWorker rank=0 pid=N)', Ray's), a
writer's tag in brackets ended by ':' ('[rank3]: ', '[default0]:', mpirun's '[1,0]<stdout>:'), `srun --label`'s
task number ('3: '), docker compose's 'svc-1  | ', journald's and RFC 3339 times in front, and the loggers'
columns: vLLM's layouts old and new ('INFO 11-20 12:00:00 model_runner.py:680]', '... [file.py:12]'),
SGLang's '[time DPn TPn]', c10d's '[E626 ...]', Python logging's '... - name - LEVEL - ', a time and a level
('2025-01-01 10:00:00,123 INFO ', loguru's '... | INFO | '), any bracketed column of times, levels, tags and
source locations (DeepSpeed's '[time] [INFO] [file.py:96:fn] '); colour codes. Rich's wrapped columns are
joined back into lines behind a launcher's or collector's prefix, and across other writers' lines between
them. A tqdm redraw with another line glued after it (no line break came between them) is two lines. A
prefix that only one engine writes names it only while no engine's own words say otherwise.

Error kinds (errors.KINDS): other, python_exception, import_error, timeout, config_error, killed, nccl,
cuda_oom; the most specific symptom of a failure names it, and a root cause stays the error when other
ranks' noise or a 'Killed' follows it: another process's error after a root cause that nothing caught is
its consequence (a peer's NCCL timeout after one rank's crash) and joins its chain without renaming it. The exception class and message come from the
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
    mid-frame), an exception line (also one the log ends in without its line end: it was cut) or an
    engine's warning of trouble that nothing healthy followed is how the run ended; a traceback that
    something caught (its outermost frame is no top level), complete or cut short where other lines
    follow, is survived. A frame line clipped before its function's name leaves that unknown: tentative.
A traceback cut short is a python_exception, of the class a frame's `raise` names when one does; one that
another writer's line interrupts goes on when its frames or its exception line follow. A pane's clipped
header ('Traceback (most rec') is a header; a class name alone must end as exception classes do.
Healthy work includes an access-log line of any answered status but a server error's (a 2xx one moves a
starting server to ready). Lines
logged at DEBUG/INFO/WARNING, Python warnings, NCCL's debug output, a file lock's debug lines and SGLang's
'Ignore import error' are never errors by their words alone (except markers that count at any level, such
as vLLM 0.33's WARNING that an engine core exited). Each error carries a hint (hints.py): a remedy and
where the advice comes from.

Engines, trainers and tools are read from tables (formats.py; sglang.py, vllm.py, speculators.py,
slurm.py), and what no table knows by its shape: any traceback, any tqdm bar (with or without a rate) and
the trainer's numbers in its postfix or label, a trainer's dict or step lines (trainers.py), a benchmark's
result block or result lines (bench.py), exit words. A trailing number of the line the log ends in without
its line end is no metric: it may have been cut.

Metrics: the engines' own statistics, and any job's `orch-metric NAME=VALUE ...` lines (see protocol.py);
each sample carries the line's own time as printed, when it shows one (stamp_time reads it).
"""

from __future__ import annotations

import os
from typing import Any

from .errors import KINDS, LogError
from .parser import PHASES, LogParser, Metric, RowReader, assumption
from .protocol import protocol_metrics
from .text import stamp_time
from .tqdm import Progress, parse_bar

__all__ = ["KINDS", "PHASES", "LogError", "LogParser", "Metric", "Progress", "RowReader", "assumption", "inspect_file",
           "parse_bar",
           "protocol_metrics", "stamp_time"]


def inspect_file(path: str | os.PathLike[str], chunk_size: int = 1 << 20,
                 samples: list[tuple[str, float]] | None = None) -> dict[str, Any]:
    """Summary of a whole log file, read in chunks so any size fits in bounded memory. `samples`, when given,
    gets every metric sample (name, value) in the log's order, from the same single read."""
    parser = LogParser()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            found = parser.feed(chunk)
            if samples is not None:
                samples += [(m.name, m.value) for m in found]
    found = parser.finish()
    if samples is not None:
        samples += [(m.name, m.value) for m in found]
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
