"""Understanding inference-engine logs: bytes in; engine, phase, progress, error and metrics out.

Pure and standard-library only: nothing here knows about hosts, runs or the database.

Errors are fatal when the log itself says the process is going down: an engine's own marker
('Scheduler hit an exception', 'Received sigquit', 'EngineCore failed to start', 'warmup error',
'Data generation failed', ...), the OOM killer or a child killed by signal 9, or torch's NCCL
watchdog. A traceback or an OOM/NCCL message with no such marker is tentative (fatal=False): the
caller decides from the exit code or the pid, and healthy work after it (a bar that moves on,
decode statistics, the ready line) clears it.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import KINDS, LogError
from .parser import PHASES, LogParser, Metric
from .tqdm import Progress, parse_bar

__all__ = ["KINDS", "PHASES", "LogError", "LogParser", "Metric", "Progress", "inspect_file", "parse_bar"]


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
             "fatal": err.fatal}
            if err else None
        ),
        "metrics": dict(parser.metrics),
    }
