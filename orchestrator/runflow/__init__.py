"""The run flow: from a spec to a finished run, and every way a run ends.

start: check → create the run with its lease → patch sets checked → GPU cleanup → patches applied →
prepare → launch. watch/poll: the watcher records what the log says until the run ends. Every ending
(the watcher's verdict, cancel, stop, another run's GPU cleanup, a dead controller's run settled, a
failed start) reaches `finish`, which runs the end steps — the log read to its last byte, outputs, log
tail, patch revert, notification — each exactly once whoever ends the run, then frees its lease. `start(replace=True)`
stops the run holding the host or GPU set through that same path (its reason names the new run) and
waits until its GPUs are free before taking the lease.

Modules below this one never call up into it: the lease and GPU cleanup get callbacks.
"""

from __future__ import annotations

from ..store.record import KILL_GRACE_S
from .context import END_STEPS, Context, LogText, follow_log, log_tail, open_run, read_log, watch_options
from .ending import abandon, cancel, end, finish, free_gpus, notification, settle_orphan, stop, stop_quietly
from .follow import keep_watching, poll, probe_orphan, refresh, watch, watcher
from .starting import DryRunTransport, Waiting, busy_message, check, dry_run, run_token, start, wait_for_host

__all__ = [
    "END_STEPS",
    "KILL_GRACE_S",
    "Context",
    "DryRunTransport",
    "LogText",
    "Waiting",
    "abandon",
    "busy_message",
    "cancel",
    "check",
    "dry_run",
    "end",
    "finish",
    "follow_log",
    "free_gpus",
    "keep_watching",
    "log_tail",
    "notification",
    "open_run",
    "poll",
    "probe_orphan",
    "read_log",
    "refresh",
    "run_token",
    "settle_orphan",
    "start",
    "stop",
    "stop_quietly",
    "wait_for_host",
    "watch",
    "watch_options",
    "watcher",
]
