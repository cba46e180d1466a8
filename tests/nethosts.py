"""Several "hosts" on one machine, each a Linux network namespace with a real sshd of its own.

`NetHosts(n, root)` makes a bridge in the root namespace and n namespaces, each joined to the bridge by
a veth pair: the bridge is 198.19.X.1/24, host i (from 1) is 198.19.X.(i+1) on its `eth0`, with `lo` up
and no default route (a lookup of the machine's DNS server then fails at once instead of timing out). The
hosts reach each other over the bridge (as the nodes of a multi-node job do) and the root namespace reaches
every one of them (as orch does over SSH). Each host runs `/usr/sbin/sshd` (tests/sshd.py's `SSHServer`
under `ip netns exec`) on port 22 of its address; all share one client key and one known_hosts file, as
`SSHFleet` does for loopback servers.

All hosts share the machine's hostname and /etc/hosts, where that name is 127.0.0.1: a gloo job must be
told its interface (GLOO_SOCKET_IFNAME=eth0), or each rank offers its peers a loopback address.

Names carry the test process's pid, and X is derived from it (the next free /24 when a route for it is
already there), so parallel test workers never collide. `close()` removes everything this object made,
also after a setup that failed half-way, and runs at interpreter exit if nobody called it. Needs root.
"""

from __future__ import annotations

import atexit
import fcntl
import getpass
import itertools
import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Self

from sshd import HostTables, SSHServer, keygen, public_key

SSH_PORT = 22
INNER_IF = "eth0"  # the veth end inside every namespace: the interface a job there binds to
_LOCK = Path(tempfile.gettempdir()) / "orch-nethosts.lock"  # choosing a subnet and claiming it is one step

_serial = itertools.count()
_open: set[NetHosts] = set()
_open_lock = threading.Lock()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def _subnet_taken(x: int) -> bool:
    return bool(_ip("-4", "route", "show", f"198.19.{x}.0/24").stdout.strip())


class NetHosts(HostTables):
    """n hosts (named net1, net2, ...) in network namespaces on one bridge; see the module's doc."""

    def __init__(self, n: int = 2, root: Path | None = None):
        if not 1 <= n <= 250:
            raise ValueError(f"between 1 and 250 hosts, not {n}")
        self.n = n
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="orch-nethosts-"))
        self.root.mkdir(parents=True, exist_ok=True)
        # unique per process and per object; an interface name has at most 15 characters, a pid 7 digits
        tag = f"{os.getpid()}x{next(_serial) % 100}"
        self.bridge = f"nb{tag}"
        self.namespaces = [f"orch-net-{tag}-{i}" for i in range(1, n + 1)]
        self.outer_ifs = [f"n{tag}h{i}" for i in range(1, n + 1)]  # the veth ends on the bridge
        self.user = getpass.getuser()
        self.client_key = keygen(self.root / "id_ed25519", comment=f"{self.user}@orch-tests")
        self.authorized_keys = self.root / "authorized_keys"
        self.authorized_keys.write_text(public_key(self.client_key) + "\n")
        self.known_hosts = self.root / "known_hosts"
        self.servers: list[SSHServer] = []
        self.subnet: int | None = None
        self._made: list[tuple[str, str]] = []  # ("link"|"netns", name), what close() must remove
        with _open_lock:
            _open.add(self)

    # -- setup ----------------------------------------------------------------------------------------

    def start(self) -> Self:
        """Make the network and start every host's sshd; on any failure, undo what was made and raise."""
        try:
            self._make_network()
            self.servers = [
                SSHServer(self.root / self.name(i), self.address(i), self.authorized_keys, port=SSH_PORT,
                          prefix=["ip", "netns", "exec", self.namespace(i)])
                for i in range(1, self.n + 1)
            ]
            self.known_hosts.write_text("".join(s.host_key_line + "\n" for s in self.servers))
            for server in self.servers:
                server.start()
        except BaseException:
            self.close()
            raise
        return self

    def _make_network(self) -> None:
        with _LOCK.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            first = os.getpid() % 250 + 1
            self.subnet = next((x for x in [*range(first, 251), *range(1, first)] if not _subnet_taken(x)), None)
            if self.subnet is None:
                raise RuntimeError("no free 198.19.X.0/24 subnet for the test hosts")
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        for i in range(1, self.n + 1):
            ns, outer = self.namespace(i), self.outer_ifs[i - 1]
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            # made right inside the namespace, the inner end may have the same name in every host
            _ip("link", "add", outer, "type", "veth", "peer", "name", INNER_IF, "netns", ns)
            self._made.append(("link", outer))
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            for args in (["link", "set", "lo", "up"], ["addr", "add", f"{self.address(i)}/24", "dev", INNER_IF],
                         ["link", "set", INNER_IF, "up"]):
                _ip("-n", ns, *args)

    # -- the hosts ------------------------------------------------------------------------------------

    def _check(self, i: int) -> None:
        if not 1 <= i <= self.n:
            raise IndexError(f"no host {i} of {self.n}")

    @property
    def gateway(self) -> str:
        """The bridge's address in the root namespace."""
        return f"198.19.{self.subnet}.1"

    def name(self, i: int) -> str:
        """Host i's name in hosts.toml (from 1): net1, net2, ..."""
        self._check(i)
        return f"net{i}"

    def address(self, i: int) -> str:
        self._check(i)
        if self.subnet is None:
            raise RuntimeError("the network is not made yet (start())")
        return f"198.19.{self.subnet}.{i + 1}"

    def namespace(self, i: int) -> str:
        """Host i's network namespace: `ip netns exec NAME cmd` runs cmd on that host."""
        self._check(i)
        return self.namespaces[i - 1]

    def interface(self, i: int) -> str:
        """The interface that holds host i's address inside its namespace (e.g. for GLOO_SOCKET_IFNAME)."""
        self._check(i)
        return INNER_IF

    def server(self, i: int) -> SSHServer:
        self._check(i)
        return self.servers[i - 1]

    def exec_prefix(self, i: int) -> list[str]:
        """The argv prefix that runs a command in host i's namespace."""
        return ["ip", "netns", "exec", self.namespace(i)]

    # -- teardown -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every sshd, kill what still runs in the namespaces, delete them and the bridge."""
        for server in self.servers:
            try:
                server.stop(timeout=5)
            except Exception:  # noqa: BLE001, S110 - a teardown that must reach the rest all the same
                pass
        for kind, name in reversed(self._made):
            if kind == "netns":
                # a namespace lives on while a process holds it: end what the tests left running there
                pids = _ip("netns", "pids", name, check=False).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                _ip("netns", "del", name, check=False)
            else:  # a veth pair goes with its namespace too, but only a moment later
                _ip("link", "del", name, check=False)
        self._made.clear()
        with _open_lock:
            _open.discard(self)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<NetHosts {self.n} on {self.bridge} 198.19.{self.subnet}.0/24>"


@atexit.register
def _close_leftovers() -> None:
    with _open_lock:
        left = list(_open)
    for hosts in left:
        try:
            hosts.close()
        except Exception:  # noqa: BLE001, S110 - best effort at exit, where nothing may raise
            pass
