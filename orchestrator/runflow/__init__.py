"""The run flow: from a spec to a finished run, and every way a run ends.

start: check → create the run with its lease → patch sets checked → preflight → the host's lease files
and run dir → GPU cleanup → patches applied → prepare → launch. Watching: the host's watcher
(orchestrator.watch, above this package) hands what the log says to the run's `recorder` until the run
ends; `look` reads a run's state once (`status --refresh`, the orphan probe). Every ending (the watcher's verdict, cancel, stop, another run's GPU cleanup,
a dead controller's run settled, a failed start) reaches `finish`, which runs the end steps — the log read
to its last byte and the patch revert, then its lease is freed, then outputs, log tail and notification —
each exactly once whoever ends the run. `start(replace=True)` stops the run holding the host or GPU set
through that same path (its reason names the new run) and waits until its GPUs are free before taking
the lease.

Modules below this one never call up into it: the lease and GPU cleanup get callbacks. Inside, the
start side (`starting`, `nodes`, `dryrun`) uses the end side (`look`, `ending`, `lastread`), never the
other way round; both use `context`, `recorder` and `watching`.
"""

from __future__ import annotations

from .context import END_STEPS, Run, follow_log, open_run, read_log, watch_options
from .dryrun import RecordingTransport, dry_run
from .ending import abandon, cancel, finish, settle_orphan, stop, stop_quietly
from .look import poll, refresh
from .nodes import start_nodes
from .starting import Waiting, busy_message, check, free_gpus, start

# What the rest of orch uses; the modules hold more.
__all__ = [
    "END_STEPS",
    "Job",
    "RecordingTransport",
    "Waiting",
    "abandon",
    "busy_message",
    "cancel",
    "check",
    "dry_run",
    "finish",
    "follow_log",
    "free_gpus",
    "open_run",
    "poll",
    "read_log",
    "refresh",
    "settle_orphan",
    "start",
    "start_nodes",
    "stop",
    "stop_quietly",
    "watch_options",
]
