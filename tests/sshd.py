"""Real OpenSSH servers on loopback for the tests.

`SSHServer` runs one `/usr/sbin/sshd -D` on 127.0.0.N and a free port, with its own ed25519 host key,
PidFile, config and log. `SSHFleet` starts several that share one client key pair and one known_hosts
file listing every server's host key, so strict host-key checking is exercised the way it is in
production.

Nothing here depends on pytest; tests/conftest.py wraps it in fixtures. Every server that was started
is stopped at interpreter exit (by its process handle or its PidFile) if nobody stopped it before, and
a server started from the main thread also gets SIGTERM if the test process is killed outright.
"""

from __future__ import annotations

import atexit
import getpass
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Self

SSHD = "/usr/sbin/sshd"
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
SSH_KEYGEN = "ssh-keygen"
PRIVSEP_DIR = Path("/run/sshd")

_live: set[SSHServer] = set()
_live_lock = threading.Lock()


def keygen(path: Path, comment: str = "orch-tests") -> Path:
    """An ed25519 key pair without passphrase at path / path.pub."""
    if not path.exists():
        subprocess.run(
            [SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
            check=True,
            stdin=subprocess.DEVNULL,
            capture_output=True,
        )
    return path


def public_key(path: Path) -> str:
    """`ssh-ed25519 AAAA...` of the key pair at path (no comment)."""
    kind, blob = Path(str(path) + ".pub").read_text().split()[:2]
    return f"{kind} {blob}"


def known_hosts_name(address: str, port: int) -> str:
    """The name OpenSSH and paramiko look up in known_hosts: bare for port 22, else `[host]:port`."""
    return address if port == 22 else f"[{address}]:{port}"


def free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the command name is in parentheses and may itself contain spaces or parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """All live descendants of pid, parents before children."""
    tree = _children_map()
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies, even by SIGKILL (no atexit)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie has already died)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _is_sshd(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe") == SSHD
    except OSError:
        return False


def _end_sessions(listener: int, grace: float = 1.0) -> None:
    """Drop every session of the sshd listener, like a host going away.

    Sessions are children of the listener in sessions of their own (sshd calls setsid), so they are
    found through the process tree. The sshd processes are killed first, which cuts the connections
    at once; the commands still running in them get SIGTERM and a moment to run their exit traps (a
    shell startup file holding a lock must not leave it behind), then SIGKILL. Jobs that detached
    (setsid, reparented to init) are no longer descendants and keep running, as on a real host.
    """
    tree = descendants(listener)
    sshd = [pid for pid in tree if _is_sshd(pid)]
    rest = [pid for pid in tree if pid not in sshd]
    for pid in sshd:
        _kill(pid, signal.SIGKILL)
    for pid in rest:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(alive(pid) for pid in rest) and time.monotonic() < deadline:
        time.sleep(0.01)
    for pid in rest:
        _kill(pid, signal.SIGKILL)
    for _ in range(5):  # anything forked meanwhile
        late = descendants(listener)
        if not late:
            break
        for pid in late:
            _kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class SSHServer:
    """One real sshd on `address:port`. The host key, port and files survive stop/start."""

    def __init__(self, root: Path, address: str, authorized_keys: Path, port: int | None = None,
                 prefix: list[str] | None = None):
        self.prefix = prefix or []  # e.g. `ip netns exec NS`: the server in a network namespace of its own
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.address = address
        self.port = port or free_port(address)
        self.authorized_keys = Path(authorized_keys)
        self.host_key = keygen(self.root / "ssh_host_ed25519_key", comment=f"sshd@{address}")
        self.config = self.root / "sshd_config"
        self.pid_file = self.root / "sshd.pid"
        self.log_file = self.root / "sshd.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()  # a test may stop the server from another thread
        self._write_config()

    # -- identity -------------------------------------------------------------------------------------

    @property
    def known_hosts_name(self) -> str:
        return known_hosts_name(self.address, self.port)

    @property
    def host_public_key(self) -> str:
        return public_key(self.host_key)

    @property
    def host_key_line(self) -> str:
        """This server's line for a known_hosts file: `[127.0.0.N]:PORT ssh-ed25519 AAAA...`."""
        return f"{self.known_hosts_name} {self.host_public_key}"

    # -- lifecycle ------------------------------------------------------------------------------------

    def _write_config(self) -> None:
        lines = [
            f"ListenAddress {self.address}:{self.port}",
            f"HostKey {self.host_key}",
            f"PidFile {self.pid_file}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            f"Subsystem sftp {SFTP_SERVER}",
            "UsePAM no",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes",
            "PermitRootLogin prohibit-password",
            "StrictModes no",
            "PrintMotd no",
            "PrintLastLog no",
            "UseDNS no",
            "X11Forwarding no",
            "LogLevel ERROR",
            "MaxSessions 50",
            "MaxStartups 100",
            "MaxAuthTries 10",
            # bash reads ~/.bashrc for a command sent over SSH only as a top-level shell (SHLVL < 2).
            # The test user's ~/.bashrc is no part of orch, and where it runs `pyenv init` every command
            # pays for a rehash and a session killed mid-rehash leaves pyenv's lock behind (later shells
            # then wait for it, or print an error into stderr). So the shells here skip it, and give up
            # on the lock at once should something else still rehash.
            "SetEnv SHLVL=1 PYENV_REHASH_TIMEOUT=0",
        ]
        self.config.write_text("\n".join(lines) + "\n")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 15) -> SSHServer:
        """Start sshd and return once it sends its SSH banner on the port."""
        with self._lock:
            return self._start(timeout)

    def _start(self, timeout: float) -> SSHServer:
        if self.running:
            return self
        PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.pid_file.unlink(missing_ok=True)
        # The death signal follows the forking thread, so only a main-thread start can ask for it.
        in_main_thread = threading.current_thread() is threading.main_thread()
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(
                [*self.prefix, SSHD, "-D", "-e", "-f", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=_die_with_parent if in_main_thread else None,  # noqa: PLW1509 - prctl's only way
            )
        with _live_lock:
            _live.add(self)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self._stop(10)
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"sshd on {self.address}:{self.port} exited with {self._proc.returncode}: "
                    f"{self.log_tail()}"
                )
            try:
                with socket.create_connection((self.address, self.port), timeout=1) as s:
                    banner = s.recv(256)
                    s.sendall(b"SSH-2.0-orch_tests_probe\r\n")  # so sshd logs no protocol error
                if banner.startswith(b"SSH-2.0-"):
                    return
                last = RuntimeError(f"unexpected banner {banner!r}")
            except OSError as exc:
                last = exc
            time.sleep(0.02)
        raise RuntimeError(f"sshd on {self.address}:{self.port} not ready after {timeout} s: {last}")

    def stop(self, timeout: float = 10) -> None:
        """Stop sshd, and drop every open session the way a host outage does; the port then refuses."""
        with self._lock:
            self._stop(timeout)

    def _stop(self, timeout: float) -> None:
        proc = self._proc
        pid = proc.pid if proc is not None else self._pid_from_file()
        if pid is not None:
            _kill(pid, signal.SIGSTOP)  # accepts nothing new while its sessions are ended
            _end_sessions(pid)
            _kill(pid, signal.SIGTERM)
            _kill(pid, signal.SIGCONT)
            if proc is not None:
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout)
            else:
                deadline = time.monotonic() + timeout
                while alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.02)
                _kill(pid, signal.SIGKILL)
        self._proc = None
        self.pid_file.unlink(missing_ok=True)
        with _live_lock:
            _live.discard(self)

    def restart(self) -> SSHServer:
        """Stop and start again on the same address, port and host key."""
        with self._lock:
            self._stop(10)
            return self._start(15)

    def _pid_from_file(self) -> int | None:
        """The PidFile's pid, if that process is still this server's sshd."""
        try:
            pid = int(self.pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return None
        return pid if str(self.config).encode() in cmdline else None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<SSHServer {self.address}:{self.port} {state}>"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        # a JSON string is a valid TOML basic string (\uXXXX escapes included)
        return json.dumps(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


class HostTables:
    """The inventory of a set of sshd servers, each reached with one client key: `servers`, `name(i)`,
    `server(i)` (i from 1), `root`, `user`, `client_key` and `known_hosts` are the set's."""

    root: Path
    user: str
    client_key: Path
    known_hosts: Path
    servers: list[SSHServer]

    def name(self, i: int) -> str:
        raise NotImplementedError

    def server(self, i: int) -> SSHServer:
        raise NotImplementedError

    def workdir(self, i: int) -> Path:
        path = self.root / "work" / self.name(i)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def host_entry(self, i: int, **overrides: Any) -> dict[str, Any]:
        """The hosts.toml fields for server i (from 1): address, port, user, keys, workdir, python."""
        server = self.server(i)
        entry: dict[str, Any] = {
            "address": server.address,
            "port": server.port,
            "user": self.user,
            "identity_file": str(self.client_key),
            "known_hosts": str(self.known_hosts),
            "workdir": str(self.workdir(i)),
            "python": sys.executable,
        }
        entry.update(overrides)
        return entry

    def hosts_toml(self, **per_host_overrides: dict[str, Any]) -> str:
        """`[hosts.NAME]` tables for every server; keyword `NAME={...}` overrides that host's fields."""
        unknown = set(per_host_overrides) - {self.name(i) for i in range(1, len(self.servers) + 1)}
        if unknown:
            raise KeyError(f"not among the hosts: {sorted(unknown)}")
        out: list[str] = []
        for i in range(1, len(self.servers) + 1):
            name = self.name(i)
            out.append(f"[hosts.{name}]")
            for key, value in self.host_entry(i, **per_host_overrides.get(name, {})).items():
                if value is not None:
                    out.append(f"{_toml_key(key)} = {_toml_value(value)}")
            out.append("")
        return "\n".join(out)


class SSHFleet(HostTables):
    """n sshd servers (named test1, test2, ...) sharing one client key and one known_hosts file.

    Server i (counting from 1, as in the names) listens on 127.0.0.(i+1).
    """

    def __init__(self, n: int = 2, root: Path | None = None, first_address: int = 2):
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="orch-sshd-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.user = getpass.getuser()
        self.client_key = keygen(self.root / "id_ed25519", comment=f"{self.user}@orch-tests")
        self.authorized_keys = self.root / "authorized_keys"
        self.authorized_keys.write_text(public_key(self.client_key) + "\n")
        self.known_hosts = self.root / "known_hosts"
        self.servers = [
            SSHServer(self.root / f"test{i}", f"127.0.0.{first_address + i - 1}", self.authorized_keys)
            for i in range(1, n + 1)
        ]
        self.known_hosts.write_text("".join(s.host_key_line + "\n" for s in self.servers))

    def start(self) -> Self:
        try:
            for server in self.servers:
                server.start()
        except BaseException:
            self.stop_all()
            raise
        return self

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()

    def server(self, i: int) -> SSHServer:
        """Server i, counting from 1."""
        if not 1 <= i <= len(self.servers):
            raise IndexError(f"no server {i} in a fleet of {len(self.servers)}")
        return self.servers[i - 1]

    def name(self, i: int) -> str:
        self.server(i)
        return f"test{i}"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def __repr__(self) -> str:
        return f"<SSHFleet {self.servers!r}>"


@atexit.register
def _stop_leftovers() -> None:
    with _live_lock:
        left = list(_live)
    for server in left:
        try:
            server.stop(timeout=5)
        except Exception:  # noqa: BLE001, S110 - best effort at exit, where nothing may raise
            pass
