"""Error kinds, the rules that recognise them, and how a later finding refines an earlier one."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

# Most specific last: when one failure shows several symptoms the highest rank names it.
#   other             a process gave up (an engine's own 'died' / 'failed to start' line) with no cause shown
#   python_exception  an exception whose class names nothing more specific
#   import_error      ImportError / ModuleNotFoundError
#   timeout           a timeout exception (TimeoutError, requests' ReadTimeout, ...)
#   config_error      the settings cannot work (vLLM's max model length larger than the KV cache holds)
#   killed            SIGKILL: a shell's 'Killed', an exit code -9, the kernel's OOM killer
#   nccl              an NCCL error or watchdog timeout on any rank
#   cuda_oom          CUDA out of memory
KINDS = ("other", "python_exception", "import_error", "timeout", "config_error", "killed", "nccl", "cuda_oom")
RANK = {kind: i for i, kind in enumerate(KINDS)}
CHAIN_MAX = 5  # later exceptions kept with a root cause
CUT_MESSAGE = "traceback cut short before its exception line"
CHAIN_CHARS = 300


@dataclass
class LogError:
    kind: str
    exception: str | None  # the root cause's class when a traceback or an exception line shows it
    message: str
    line: int
    context: list[str] = field(default_factory=list)
    fatal: bool = False
    # Exceptions raised later in the same failure, 'Class: message', the last one last: the rest of a
    # chained traceback ('The above exception was the direct cause ...'), or what other processes raised
    # because of the root cause ('Engine core initialization failed').
    chain: list[str] = field(default_factory=list)
    hint: str | None = None  # what to try, and where that advice comes from (hints.py)
    source: str = ""  # the process that wrote it, where its lines say ('/rank3', 'Worker_TP1'); '' if unknown

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LogError:
        return cls(**d)


class Rule(NamedTuple):
    pattern: re.Pattern[str]
    kind: str
    fatal: bool  # the line itself says the run cannot go on
    cause: bool  # names why it failed, rather than only that something gave up
    versions: str = ""  # the engine versions that print it ('0.4.10-0.5.23'); '' for any program
    source: str = ""  # where the engine's source holds the format string
    any_level: bool = False  # counts even when logged at INFO/WARNING (or by a program without levels)


def rule(pattern: str, kind: str, fatal: bool, cause: bool | None = None, versions: str = "",
         source: str = "", any_level: bool = False) -> Rule:
    return Rule(re.compile(pattern), kind, fatal, kind not in ("other", "killed") if cause is None else cause,
                versions, source, any_level)


# Symptoms any program can print; engine modules add their own markers.
COMMON_RULES = [
    # Tentative: a caught OOM is retried by the engines, so the process decides.
    rule(r"CUDA out of memory|CUDA error: out of memory|OutOfMemoryError|cudaErrorMemoryAllocation"
         r"|CUBLAS_STATUS_ALLOC_FAILED", "cuda_oom", False),
    # Any other CUDA error leaves the context unusable: the process cannot go on.
    rule(r"CUDA error:|CUDA driver error|CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|cudaError[A-Z]\w+"
         r"|an illegal memory access was encountered|device-side assert triggered", "other", True),
    # The kernel's OOM killer, or a child reported dead by SIGKILL (-9), which is what it sends.
    rule(r"Out of memory: Kill|invoked oom-killer|oom-kill:|oom_kill_process|[Ee]xit ?code:? *-9\b"
         r"|exited with code -9\b|killed by signal 9\b|Signal 9 \(SIGKILL\)|signal SIGKILL|signal 9:SIGKILL"
         r"|\b(?:[Ee]xit(?:ed)?|[Rr]eturned)(?: with)?(?: exit)? (?:code|status)[:=]? ?137\b", "killed", True, True,
         any_level=True),  # 137: a shell's 128 + 9
    # torch elastic's agent stopping its workers on a signal it was sent (SIGTERM, SIGINT, SIGHUP: its
    # 'death signal'), then raising SignalException: the job was killed from outside (by whom, and why, it
    # does not say: a scheduler's time limit before it stays the cause).
    rule(r"Received (?:Signals\.)?SIG[A-Z]+ death signal|Received \d+ death signal"
         r"|SignalException: Process \d+ got signal: ?\d+", "killed", True, any_level=True),
    # A shell's 'Killed' (also glued to the bar it interrupted): SIGKILL, from whom the log may not say.
    rule(r"^Killed\s*$|\]Killed\s*$|^\S+: line \d+: +\d+ Killed\b", "killed", True, False),
    # One rank's NCCL failure leaves the others hanging in their next collective.
    rule(r"DistBackendError|NCCL error|nccl(?:UnhandledCuda|System|Internal|Remote|InvalidArgument)Error"
         r"|ncclInvalidUsage|NCCL communicator was aborted|Watchdog caught collective operation timeout"
         r"|NCCL watchdog thread terminated", "nccl", True),
    # torchrun reporting that a child it launched failed; a crash below Python.
    rule(r"ChildFailedError|^Fatal Python error: |Segmentation fault|\(core dumped\)"
         r"|^terminate called after throwing an instance of", "other", True),
    # A patch that no longer applies to the sources it was made for.
    rule(r"^Hunk #\d+ FAILED at \d+|^\d+ out of \d+ hunks? FAILED|^error: patch failed: "
         r"|: patch does not apply$", "other", True, any_level=True),
    # A wrapper's own account of the exit ('Process finished with exit code 1', 'exited with code 2').
    rule(r"\b(?:[Ee]xit(?:ed)?|[Rr]eturned)(?: with)?(?: exit)? (?:code|status)[:=]? ?[1-9]\d*\.?"
         r"(?: \([^)]{0,80}\))?\s*$", "other", True, any_level=True),
    # vLLM refuses to start with a max model length its KV cache cannot hold.
    rule(r"max seq len \(\d+\) is larger than|stored in KV cache \(\d+\)"
         r"|KV cache is needed, which is larger than the available KV cache memory"
         r"|is greater than the derived max_model_len", "config_error", True),
]

# Lines that mention errors without being one: SGLang skipping optional models, NCCL's debug output.
# Python's warnings ('x.py:12: UserWarning: ...') are warnings whatever they quote.
HARMLESS = re.compile(r"Ignore import error when loading|NCCL (?:INFO|WARN)\b|^\S+\.py:\d+: [A-Z]\w*Warning: "
                      r"|^(?:DEBUG|INFO):filelock:")

# An exception line: 'torch.OutOfMemoryError: CUDA out of memory. ...', or only 'TypeError' when the
# message is empty. The class's own name is capitalised, which keeps source lines and prose out; a level word
# ('INFO: ...', another process's line in the middle of a traceback) is no class. A class alone must end the
# way exception classes do: a line clipped inside a longer name ('torch.OutOfMemoryErr') names none.
EXCEPTION_LINE = re.compile(
    r"^(?!(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL|FATAL|NOTICE|TRACE)\b)"
    r"(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*)(?::(?: ?(?P<message>.*))?|(?<=rror|tion|Exit|rupt|ning|lure))$"
)
# The same with a message, for lines outside a traceback: only names that say they are errors.
_BARE_EXCEPTION = re.compile(
    r"^(?P<type>(?:[A-Za-z_]\w*\.)*(?:[A-Z]\w*)?(?:Error|Exception|Exit|Interrupt|Failure|Unsupported))"
    r":(?: +(?P<message>\S.*)| *)$"  # torchrun's ChildFailedError prints its message on the lines after
)


def exception_line(text: str, bare: bool = False) -> tuple[str, str] | None:
    """(class, message) of an exception line; also when a user wrapped it in '**' or backticks."""
    t = text.strip()
    if t[:1] in ("*", "`") or t[-1:] in ("*", "`"):
        t = t.strip("*`").strip()
    m = (_BARE_EXCEPTION if bare else EXCEPTION_LINE).match(t)
    if m is None:
        return None
    return m.group("type"), (m.group("message") or "").strip()


def exception_kind(exception: str) -> str:
    name = exception.rsplit(".", 1)[-1]
    if name in ("ImportError", "ModuleNotFoundError"):
        return "import_error"
    if "Timeout" in name:
        return "timeout"
    return "python_exception"


def classify(text: str, rules: list[Rule]) -> tuple[str, bool, bool] | None:
    """(kind, fatal, cause) from every rule matching `text`: the highest ranked kind (of two ranked alike, one
    that names a cause), fatal if any rule says so."""
    kind: str | None = None
    fatal = cause = False
    for r in rules:
        if r.pattern.search(text):
            if kind is None or RANK[r.kind] > RANK[kind] or (r.kind == kind and r.cause and not cause):
                kind = r.kind
                cause = r.cause
            fatal = fatal or r.fatal
    return None if kind is None else (kind, fatal, cause)


def merge(cur: LogError, new: LogError, chained: bool, cause: bool, cur_cause: bool = True,
          cur_caught: bool = False) -> LogError:
    """What is known after `new` is found while `cur` stands.

    Fatal is never taken back. The details (exception, message, line, context) stay with the first root
    cause: a marker ('scheduler died') keeps the traceback before it, a traceback fills in a marker that had
    none, a more specific cause replaces them, and a chained or post-mortem exception joins the chain
    instead of hiding the one that started the failure. A bare 'Killed' after an exception or another cause
    (a cut traceback, Slurm's time limit) does not rename it: what killed the process is not said; the
    kernel's OOM-killer line after it does say.
    `cause` and `cur_cause`: whether the rules that found `new` and `cur` name a cause. An exception that
    something caught (`cur_caught`) is no root cause of a later one; one that nothing is known to have caught
    is, as a fatal one is: what other processes raise after it is its consequence.
    """
    # Another process's error after a root cause that nothing caught is its consequence (a peer's NCCL
    # timeout after one rank's crash): it joins the chain, and renames nothing.
    consequence = (new.source != cur.source and not cur_caught
                   and (cur.exception is not None or cur.message == CUT_MESSAGE))
    higher = RANK[new.kind] > RANK[cur.kind] and not consequence
    if consequence:
        take_new = False
    elif cur.exception is None:
        # A cause replaces a line that only said something gave up ('srun: Job step aborted', then Slurm's
        # time limit), whatever their ranks.
        take_new = new.exception is not None or (cause and (higher or not cur_cause))
    elif new.exception is None:
        take_new = False
    else:
        take_new = (higher and cause) or (cur_caught and not (cur.fatal or chained))
    base = new if take_new else cur
    # What only says something gave up (a task 'Killed' after the time limit) renames no cause.
    renames = higher and (cause or (cur.exception is None and not cur_cause))
    kind = new.kind if take_new or renames else cur.kind
    chain = list(base.chain)
    if not take_new and new.exception is not None and (new.exception, new.message) != (cur.exception, cur.message):
        entry = f"{new.exception}: {new.message}" if new.message else new.exception
        if entry[:CHAIN_CHARS] not in chain and len(chain) < CHAIN_MAX:
            chain.append(entry[:CHAIN_CHARS])
    return LogError(
        kind=kind,
        exception=base.exception,
        message=base.message,
        line=base.line,
        context=list(base.context),
        fatal=cur.fatal or new.fatal,
        chain=chain,
        hint=cur.hint,
        source=base.source,
    )


def describe(err: Any) -> str:
    """An error in one line: kind, exception and message, and what a chain ended in."""
    head = err.exception or err.kind
    text = f"{err.kind}: {head}: {err.message}" if err.message else f"{err.kind}: {head}"
    chain = getattr(err, "chain", None)
    return f"{text} (then {chain[-1]})" if chain else text  # the root cause, and what it ended in
