"""Where a run's job runs: the one small interface the run flow and the watcher drive a job through.

An executor starts a job script in its run dir, reports the job's state with the new bytes of its log,
and stops it. A job is named by a handle of two values the executor gives meaning to (on a host: the
wrapper's pid and its start time). `HostExecutor` runs jobs on a host over its transport (SSH, or this
machine) under `setsid nohup`; a batch scheduler is one more class with the same four methods.
"""

from __future__ import annotations

from . import launch
from .hosts import Host
from .launch import JobState, RunPaths
from .remote import Transport

Handle = tuple[int, str]


class Executor:
    transport: Transport

    def launch(self, paths: RunPaths, script: str, token: str) -> Handle:
        """Start the job (idempotent for the same token); its handle."""
        raise NotImplementedError

    def poll(self, paths: RunPaths, handle: Handle, offset: int, max_bytes: int, hold_s: float = 0,
             wake: str | None = None, wake_perl: str | None = None) -> JobState:
        """Is the job alive, its exit code, and its log's bytes from `offset`. May first wait up to `hold_s`
        for news: the job's end, or a new log line matching `wake` (extended regex) or `wake_perl`."""
        raise NotImplementedError

    def kill(self, handle: Handle, grace_s: float) -> str:
        """Stop the job, provably this one: 'gone' | 'stopped' | 'killed'."""
        raise NotImplementedError

    def tail(self, paths: RunPaths, lines: int) -> str:
        raise NotImplementedError


class HostExecutor(Executor):
    def __init__(self, transport: Transport):
        self.transport = transport

    def launch(self, paths: RunPaths, script: str, token: str) -> Handle:
        return launch.launch(self.transport, paths, script, token)

    def poll(self, paths: RunPaths, handle: Handle, offset: int, max_bytes: int, hold_s: float = 0,
             wake: str | None = None, wake_perl: str | None = None) -> JobState:
        return launch.read_state(self.transport, paths, handle[0], handle[1], offset, max_bytes, hold_s=hold_s,
                                 wake=wake, wake_perl=wake_perl)

    def kill(self, handle: Handle, grace_s: float) -> str:
        return launch.kill(self.transport, handle[0], handle[1], grace_s)

    def tail(self, paths: RunPaths, lines: int) -> str:
        return self.transport.run(launch.tail_command(paths, lines), timeout=60).stdout


def executor_for(host: Host, transport: Transport) -> Executor:
    """The executor for a host of the inventory."""
    return HostExecutor(transport)
