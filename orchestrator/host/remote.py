"""One transport per host for this process: over SSH, or on this machine. The interface and the local
transport are in transport.py, SSH in ssh.py."""

from __future__ import annotations

import threading

from ..config.hosts import Host
from . import session
from .ssh import SSHTransport, ssh_retry
from .transport import DEFAULT_TIMEOUT_S, LocalTransport, Result, Transport, env_exports, quote

_pool_lock = threading.Lock()


def connect(host: Host) -> Transport:
    """The one transport per host for this process."""
    pool = session.current().transports
    with _pool_lock:
        transport = pool.get(host.name)
        if transport is None or transport.host != host:
            transport = LocalTransport(host) if host.on_this_machine else SSHTransport(host)
            pool[host.name] = transport
        return transport


def close_all() -> None:
    pool = session.current().transports
    with _pool_lock:
        for transport in pool.values():
            transport.close()
        pool.clear()


def probe(host: Host, timeout: float = 10) -> str:
    """One round trip: the host's uname, or raises."""
    return connect(host).run("uname -srm", timeout=timeout).stdout.strip()


__all__ = ["DEFAULT_TIMEOUT_S", "LocalTransport", "Result", "SSHTransport", "Transport", "close_all", "connect",
           "env_exports", "probe", "quote", "ssh_retry"]
