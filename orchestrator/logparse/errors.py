"""Error kinds, the rules that recognise them, and how a later finding refines an earlier one."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

# Most specific last: when one failure shows several symptoms the highest rank names it.
KINDS = ("exception", "scheduler_died", "warmup_failed", "nccl", "host_oom", "cuda_oom")
RANK = {kind: i for i, kind in enumerate(KINDS)}
# Kinds that name a cause rather than the fact that some process gave up.
CAUSES = frozenset({"nccl", "host_oom", "cuda_oom"})


@dataclass
class LogError:
    kind: str
    exception: str | None
    message: str
    line: int
    context: list[str] = field(default_factory=list)
    fatal: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LogError:
        return cls(**d)


class Rule(NamedTuple):
    pattern: re.Pattern[str]
    kind: str
    fatal: bool  # the line itself says the process is going down


def rule(pattern: str, kind: str, fatal: bool) -> Rule:
    return Rule(re.compile(pattern), kind, fatal)


# Symptoms any program can print; engine modules add their own fatal markers.
COMMON_RULES = [
    rule(
        r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|cudaErrorMemoryAllocation"
        r"|CUBLAS_STATUS_ALLOC_FAILED",
        "cuda_oom",
        False,
    ),
    # The kernel's OOM killer, or a child reported dead by SIGKILL (-9), which is what it sends.
    rule(
        r"Out of memory: Kill|invoked oom-killer|oom-kill:|[Ee]xit ?code:? *-9\b|exited with code -9\b"
        r"|killed by signal 9\b|Signal 9 \(SIGKILL\)|^Killed\s*$|^\S+: line \d+: +\d+ Killed\b",
        "host_oom",
        True,
    ),
    rule(
        r"DistBackendError|NCCL error|nccl(?:UnhandledCuda|System|Internal|Remote)Error|ncclInvalidUsage"
        r"|NCCL communicator was aborted",
        "nccl",
        False,
    ),
    # torch's NCCL watchdog takes the whole process down after a collective timeout.
    rule(r"Watchdog caught collective operation timeout|NCCL watchdog thread terminated", "nccl", True),
    # torchrun reporting that a child it launched failed.
    rule(r"ChildFailedError", "exception", True),
]

# Lines that mention errors without being one.
HARMLESS = re.compile(r"Ignore import error when loading")


def classify(text: str, rules: list[Rule]) -> tuple[str, bool] | None:
    """(kind, fatal) from every rule matching `text`: the highest ranked kind, fatal if any rule says so."""
    kind: str | None = None
    fatal = False
    for r in rules:
        if r.pattern.search(text):
            if kind is None or RANK[r.kind] > RANK[kind]:
                kind = r.kind
            fatal = fatal or r.fatal
    return None if kind is None else (kind, fatal)


def merge(cur: LogError, new: LogError, chained: bool) -> LogError:
    """What is known after `new` is found while `cur` stands.

    The most specific kind wins and fatal is never taken back. The details (exception, message, line,
    context) stay with the first root cause: a marker ('scheduler died') keeps the traceback before it,
    a traceback fills in a marker that had none, a more specific cause replaces them, and a chained or
    post-mortem traceback does not hide the one that started the failure.
    """
    higher = RANK[new.kind] > RANK[cur.kind]
    if (cur.exception is None and new.exception is not None) or (
            higher and (new.kind in CAUSES or cur.exception is None)):
        take_new = True
    elif new.exception is None:
        take_new = False
    elif higher:
        take_new = True
    else:
        take_new = not (cur.fatal or chained)
    base = new if take_new else cur
    kind = new.kind if higher else cur.kind
    return LogError(
        kind=kind,
        exception=base.exception,
        message=base.message,
        line=base.line,
        context=list(base.context),
        fatal=cur.fatal or new.fatal,
    )
