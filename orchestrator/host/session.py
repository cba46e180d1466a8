"""The part of a process's state (orchestrator/state.py) that concerns hosts: the options that concern every
host it reaches (the inventory file, whether retries are told, how a transfer is shown) and the things it
shares between the calls it makes (one connection per host, one agent link per connection, one queue
reader per cluster). `current()` is it, in the process's state: a `state.fresh()` one starts without it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import state

if TYPE_CHECKING:
    from .agent import AgentLink
    from .slurm import Queue
    from .transport import Transport

# Shows a transfer as it goes: given what it is and its size in bytes, a context whose value is told the
# byte count of each piece moved.
Meter = Callable[[str, int], AbstractContextManager[Callable[[int], object]]]


@dataclass
class Session:
    hosts_file: Path | None = None  # `orch --hosts FILE`; None: the workspace's hosts.toml
    quiet_retries: bool = False  # --json: stderr carries no retry lines (stdout is the document)
    # Told of each SSH retry in words (what failed, attempt N of M, the wait); the CLI points it at stderr,
    # except under --json. None: retries are silent (a background watcher, the library in tests).
    retry_notice: Callable[[str], None] | None = None
    # The CLI sets one on a terminal; None: transfers are silent (--json, a pipe, a watcher, the library).
    transfer_meter: Meter | None = None
    transports: dict[str, Transport] = field(default_factory=dict)  # by host name (remote.connect)
    agent_links: dict[int, tuple[Transport, AgentLink]] = field(default_factory=dict)  # by id(transport)
    agent_starts: dict[int, threading.Lock] = field(default_factory=dict)  # one start at a time per host
    queues: dict[str, Queue] = field(default_factory=dict)  # a cluster's scheduler queue, by host name


_making = threading.Lock()  # two threads asking first (two watchers) get one session


def current() -> Session:
    held = state.current()
    if held.host_session is None:
        with _making:
            if held.host_session is None:
                held.host_session = Session()
    return held.host_session
