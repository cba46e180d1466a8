"""Sweeps: one playbook over a grid of spec values, spread over hosts, resumable, with a failure policy.

The sweep file (TOML) names the playbook, the hosts (or tags), a base `[spec]`, a `[matrix]` whose every
combination of values is a point (dotted keys such as `"env.X"` reach into tables) and `[[include]]`
extra points. Every point is validated before anything starts. Points go round-robin over the hosts;
a host runs one point at a time, or one per GPU set when points ask for `gpus` (the leases keep
overlapping sets apart whatever the file says).

A sweep is its name, the sha256 of its file and an instance (free text, '' by default; a nightly cron
entry uses the date): running the same file with the same instance again resumes it. Points that
succeeded, or failed by a crash inside the job, are not run again; a run whose controller died is
watched again (or settled, when it never launched); every other point runs. A changed file is a new
sweep (the old one stays in the history under the same name).

Failures that are the fleet's fault (host unreachable at start, a job `lost`) are retried `retries`
times, `retry_backoff_s` apart; a crash inside the job never is. With `fail_fast`, the first job
failure cancels the points still queued.

A sweep with `[search]` instead of `[matrix]` proposes its points as it goes (Optuna's TPE, its pruners
and constraints), stops losers early from their live metrics, learns from crashes whose cause the log
names, and is rebuilt from the records whenever its file runs again (see search.py).

The modules, from the bottom up: `record` (statuses, transitions, faults, rows), `space` (a search's
space and bounds), `plan` (the file and its points), `policy` (the pure retry policy), `outcome` (what a
searched point teaches), `db` (rows, events, transitions), `search` (the optimizer), `status` (the JSON
documents), `notification` (what the URLs are told), `runner` (the lanes and points), `control` (the
commands).
"""

from ..store.sweeps import add_event, events
from .control import cancel, detach, on_sweep_finished, record_cron_skip, run
from .db import claim, on_run_ended, register, resolve
from .plan import Plan, Point, SweepFile, expand, label, load, plan
from .policy import Verdict, decide, verdict
from .record import Fault, PointStatus, SweepStatus
from .status import best_line, changes, document, follow, list_sweeps, point_line, search_lines

__all__ = [
    "Fault",
    "Plan",
    "Point",
    "PointStatus",
    "SweepFile",
    "SweepStatus",
    "Verdict",
    "add_event",
    "best_line",
    "cancel",
    "changes",
    "claim",
    "decide",
    "detach",
    "document",
    "events",
    "expand",
    "follow",
    "label",
    "list_sweeps",
    "load",
    "on_run_ended",
    "on_sweep_finished",
    "plan",
    "point_line",
    "record_cron_skip",
    "register",
    "resolve",
    "run",
    "search_lines",
    "verdict",
]
