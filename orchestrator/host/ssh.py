"""Commands on a host over SSH (Fabric/Paramiko): strict host keys, plain-words errors, reconnects on
transient failures by the named policy `ssh_retry`, keepalives, and a watchdog for a link gone dark."""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import io
import logging
import os
import posixpath
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

import tenacity

from ..config.hosts import Host
from ..errors import AuthFailed, HostKeyError, RemoteError, Unreachable
from . import session
from .hostkeys import (
    RefuseRevoked,
    RefuseUnknownKey,
    SaveNewKeyPolicy,
    UnknownKey,
    fingerprint,
    load_known_hosts,
)
from .transport import DEFAULT_TIMEOUT_S, RemoteFile, Result, Stream, Transport, write_pieces

KEEPALIVE_S = 15  # SSH keepalives, so an idle connection through NAT stays up
# A long-lived command's channel (a host agent's, carrying its runs' logs): paramiko's Python handles every
# packet, so bigger ones cost less per byte; the window lets a backlog stream without waiting on each
# acknowledgement (what waits in memory stays bounded by it).
STREAM_WINDOW = 8 << 20
STREAM_PACKET = 256 << 10
# A file read over SFTP: this many bytes are asked for at once, in requests of up to SFTP_PIECE each, so
# the link stays busy without waiting on each answer while what waits in memory stays bounded.
READ_AHEAD = 8 << 20
# What OpenSSH's sftp-server answers to one read (256 KiB less its message's head room); paramiko's own 32
# KiB costs three times the CPU per byte. A server that answers less (older ones: 64 KiB) is met at its size.
SFTP_PIECE = 255 << 10

# Paramiko logs what fails in its transport thread, traceback and all, and Python's last-resort handler
# prints that on stderr (a watcher's log): every such failure reaches orch as an exception too, and is
# said there in one line.
_paramiko_log = logging.getLogger("paramiko")
_paramiko_log.addHandler(logging.NullHandler())
_paramiko_log.propagate = False


class _Activity(io.StringIO):
    """Where a command's output is mirrored as it arrives: only the time of the last piece is kept."""

    def __init__(self) -> None:
        super().__init__()
        self.last = time.monotonic()

    def write(self, text: str) -> int:
        self.last = time.monotonic()
        return len(text)


class _Watchdog:
    """Closes the connection when a command stays silent past `idle_s` (a dark link, not a slow host:
    commands given an idle timeout write a byte every few seconds while they wait)."""

    def __init__(self, conn: Any, activity: _Activity, idle_s: float):
        self.conn, self.activity, self.idle_s = conn, activity, idle_s
        self.fired = False
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="orch-ssh-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self._done.wait(min(1.0, self.idle_s / 4)):
            if time.monotonic() - self.activity.last > self.idle_s:
                self.fired = True
                with contextlib.suppress(Exception):
                    self.conn.close()  # the blocked read returns; every call on this connection reconnects
                return

    def stop(self) -> None:
        self._done.set()


class _ChannelStream(Stream):
    """A command's stdin and stdout over one SSH channel of the host's connection."""

    def __init__(self, channel: Any):
        self.channel = channel

    def send(self, data: bytes) -> None:
        try:
            self.channel.sendall(data)
        except Exception as exc:  # socket errors and paramiko's SSHException alike: the channel is gone
            raise EOFError(f"the channel is closed: {exc}") from exc

    def recv(self, n: int) -> bytes:
        try:
            return bytes(self.channel.recv(n))
        except Exception:  # noqa: BLE001 - a channel that fails to read has ended
            return b""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.channel.close()


@functools.cache
def _gcm_first(paramiko: Any) -> Any:
    """paramiko's Transport preferring AES-GCM (any OpenSSH since 6.2 offers it): one call per packet
    decrypts and checks it, where CTR adds an HMAC computed through Python's hmac module; this halves
    paramiko's CPU per byte of a streamed log. The others stay, in paramiko's order, for a server without it."""
    gcm = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")

    class GcmFirst(paramiko.Transport):  # type: ignore[misc]
        _preferred_ciphers = gcm + tuple(c for c in paramiko.Transport._preferred_ciphers if c not in gcm)

    return GcmFirst


class _ConnectionLost(Unreachable):
    """The connection dropped while a command ran. Not retried: the command may have had effects."""


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, Unreachable) and not isinstance(exc, (HostKeyError, _ConnectionLost))


ATTEMPTS = 4


def _tell_retry(state: tenacity.RetryCallState, attempts: int) -> None:
    retry_notice = session.current().retry_notice  # see session.py
    if retry_notice is None or state.outcome is None:
        return
    wait = state.next_action.sleep if state.next_action else 0
    retry_notice(f"{state.outcome.exception()} (attempt {state.attempt_number} of {attempts}); "
                 f"retrying in {wait:.1f} s")


def ssh_retry(sleep: Callable[[float], None] = time.sleep, attempts: int = ATTEMPTS) -> tenacity.Retrying:
    """The retry policy for SSH calls: a few quick reconnects for refused/reset/timed-out connections."""
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception(_is_transient),
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_exponential(multiplier=0.5, max=8),
        sleep=sleep,
        before_sleep=lambda state: _tell_retry(state, attempts),
        reraise=True,
    )


class _SFTPFile(RemoteFile):
    """A file read over the connection's SFTP session, READ_AHEAD bytes asked for at a time. It holds the
    session (one thread at a time uses it) until closed."""

    def __init__(self, owner: SSHTransport, conn: Any, file: Any, size: int, mode: int, release: Callable[[], None]):
        self._owner, self._conn, self._file, self._release = owner, conn, file, release
        file.MAX_REQUEST_SIZE = SFTP_PIECE  # paramiko splits what it is asked for into requests of this size
        self.size, self.mode, self._at = size, mode, 0
        self._pieces: collections.deque[bytes] = collections.deque()

    def read(self, n: int) -> bytes:
        if not self._pieces:
            self._fill()
        taken, got = [], 0
        while self._pieces and got < n:
            piece = self._pieces.popleft()
            if got + len(piece) > n:
                piece, rest = piece[:n - got], piece[n - got:]
                self._pieces.appendleft(rest)
            taken.append(piece)
            got += len(piece)
        return b"".join(taken)

    def _fill(self) -> None:
        import paramiko

        try:
            piece = self._owner._sftp_piece or self._learn_piece()
            want = min(READ_AHEAD, self.size - self._at)
            if want <= 0 or not piece:
                return
            asked = [(self._at + i, min(piece, want - i)) for i in range(0, want, piece)]
            for (_, length), data in zip(asked, self._file.readv(asked), strict=False):
                self._pieces.append(data)
                self._at += len(data)
                if len(data) < length:  # the file was cut short since it was opened
                    self.size = self._at
                    break
        except EOFError:
            self.size = self._at
        except (OSError, paramiko.SSHException) as exc:
            self._owner._lost_sftp(self._conn)
            raise Unreachable(self._owner.host.name, f"reading a file over SFTP: {exc or type(exc).__name__}") from None

    def _learn_piece(self) -> int:
        """The session's first read: one request, alone, for SFTP_PIECE bytes; what the server answers is the
        most it gives at once (asked for more, paramiko would fetch the rest one request at a time). Its
        bytes are the file's first piece. 0: the file ended before anything could be told."""
        ask = min(SFTP_PIECE, self.size - self._at)
        if ask <= 0:
            return 0
        self._file.seek(self._at)
        first = self._file._read(ask)  # paramiko's single request: what the server gave, not topped up
        if not first:
            self.size = self._at
            return 0
        self._pieces.append(first)
        self._at += len(first)
        if len(first) < ask or ask == SFTP_PIECE:  # short: the server's own bound (or a file cut short)
            self._owner._sftp_piece = len(first)
        return len(first)

    def close(self) -> None:
        try:
            with contextlib.suppress(Exception):  # a dead connection fails to close it; it is discarded either way
                self._file.close()
        finally:
            self._release()


class SSHTransport(Transport):
    retry_sleep: Callable[[float], None] = staticmethod(time.sleep)  # type: ignore[assignment]

    def __init__(self, host: Host):
        self.host = host
        self._conn: Any = None
        # Guards making and dropping the connection only: commands run concurrently on their own
        # channels, so one watcher holding a poll open on the host never blocks another run's calls.
        self._lock = threading.Lock()
        self._sftp_lock = threading.Lock()  # one SFTP session per connection, used by one thread at a time
        self._sftp: tuple[Any, Any] | None = None  # (connection, its SFTP session), opened at the first file
        self._sftp_piece = 0  # the most the session's server answers to one read, once learnt
        self._revoked: set[str] = set()  # host keys marked @revoked in known_hosts

    def _connect(self) -> Any:
        import paramiko
        from fabric import Config, Connection

        host = self.host
        kwargs: dict[str, Any] = {}
        if host.identity_file:
            kwargs["key_filename"] = os.path.expanduser(host.identity_file)
        conn = Connection(
            host.address or host.name,
            user=host.user,
            port=host.port,
            connect_timeout=int(host.connect_timeout),
            connect_kwargs=kwargs,
            config=Config(overrides={"run": {"hide": True, "warn": True, "in_stream": False}}),
        )
        hop: Any = conn
        while isinstance(hop, Connection):  # harden every hop of a ProxyJump chain
            self._check_host_keys(hop.client, paramiko)
            hop.connect_kwargs.setdefault("transport_factory", _gcm_first(paramiko))
            hop = hop.gateway
        try:
            conn.open()
            RefuseRevoked(self._revoked, self._known_name(), None).missing_host_key(
                None, "", conn.transport.get_remote_server_key())
            conn.transport.set_keepalive(KEEPALIVE_S)
        except paramiko.BadHostKeyException as exc:
            raise HostKeyError(host.name, self._changed_key(exc)) from None
        except paramiko.AuthenticationException as exc:
            # a wrong key or user does not heal on retry
            raise AuthFailed(
                host.name, f"authentication failed for user {conn.user!r} at {self._where()}: "
                f"{str(exc) or type(exc).__name__} (is the key in identity_file or your ssh-agent authorized there?)"
            ) from None
        except UnknownKey as exc:
            raise HostKeyError(host.name, str(exc)) from None
        except paramiko.ssh_exception.NoValidConnectionsError as exc:
            refused = all(getattr(e, "errno", None) == errno.ECONNREFUSED for e in exc.errors.values())
            what = "connection refused" if refused else str(exc)
            raise Unreachable(host.name, f"{what} at {self._where()} (is sshd running there, on that port?)") from None
        except socket.gaierror:
            raise Unreachable(host.name, f"no such host: {host.address or host.name!r} does not resolve (DNS); "
                              "check address in hosts.toml or your ~/.ssh/config") from None
        except TimeoutError:
            raise Unreachable(host.name, f"no answer from {self._where()} within {host.connect_timeout:g} s") from None
        except paramiko.SSHException as exc:
            if "protocol banner" in str(exc):  # closed before SSH began: no sshd there, or a busy one
                raise Unreachable(host.name, f"{self._where()} closed the connection before SSH began (sshd busy "
                                  "with other connections, past its MaxStartups?)") from None
            raise Unreachable(host.name, str(exc) or type(exc).__name__) from None
        except (OSError, EOFError) as exc:
            raise Unreachable(host.name, str(exc) or type(exc).__name__) from None
        return conn

    def _where(self) -> str:
        return f"{self.host.address or self.host.name}:{self.host.port or 22}"

    def _known_name(self) -> str:
        """The host as known_hosts names it: `addr`, or `[addr]:port` off port 22."""
        address = self.host.address or self.host.name
        return address if self.host.port in (None, 22) else f"[{address}]:{self.host.port}"

    def _changed_key(self, exc: Any) -> str:
        files = " and ".join(f for f in ("~/.ssh/known_hosts", self.host.known_hosts) if f)
        return (f"host key changed for {self._known_name()}: it offers {exc.key.get_name()} {fingerprint(exc.key)}, "
                f"known_hosts has {fingerprint(exc.expected_key)}; refusing to connect. If the host was reinstalled "
                f"(ask its admin), remove the old key: ssh-keygen -R '{self._known_name()}'"
                + (f" -f {self.host.known_hosts}" if self.host.known_hosts else "") + f" (in {files}), then connect again")

    def _check_host_keys(self, client: Any, paramiko: Any) -> None:
        extra = os.path.expanduser(self.host.known_hosts) if self.host.known_hosts else None
        revoked: set[str] = set()
        for path in (os.path.expanduser("~/.ssh/known_hosts"), extra):
            if path:
                revoked |= load_known_hosts(client.get_host_keys(), path)
        self._revoked = revoked
        policy: Any = (SaveNewKeyPolicy(extra or os.path.expanduser("~/.ssh/known_hosts"))
                       if self.host.accept_new_host_key else RefuseUnknownKey(self._known_name(), self.host.port))
        client.set_missing_host_key_policy(RefuseRevoked(revoked, self._known_name(), policy))

    def _connection(self) -> Any:
        if self._conn is None or not self._conn.is_connected:
            self._drop()
            self._conn = self._connect()
        return self._conn

    def _drop(self, conn: Any = None) -> None:
        """Discard the connection (only `conn`, when given: another thread may have replaced it)."""
        if self._conn is not None and (conn is None or conn is self._conn):
            if self._sftp is not None and self._sftp[0] is self._conn:
                with contextlib.suppress(Exception):
                    self._sftp[1].close()
                self._sftp = None
            with contextlib.suppress(Exception):  # a dead connection may fail to close; it is discarded either way
                self._conn.close()
            self._conn = None

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(connection) with reconnects on transient failures."""
        import paramiko

        for attempt in ssh_retry(sleep=self.retry_sleep):
            with attempt:
                with self._lock:
                    conn = self._connection()
                try:
                    return fn(conn)
                except FileNotFoundError:
                    raise  # the host's answer about a file, not a failed link
                except (_ConnectionLost, OSError, EOFError, paramiko.SSHException) as exc:
                    with self._lock:
                        self._drop(conn)
                    if isinstance(exc, _ConnectionLost):
                        raise
                    if isinstance(exc, paramiko.AuthenticationException):
                        raise AuthFailed(self.host.name, f"authentication failed: {exc}") from None
                    raise Unreachable(self.host.name, str(exc) or type(exc).__name__) from None
        raise AssertionError("unreachable")  # tenacity reraises

    def run(self, command: str, *, check: bool = True, timeout: float | None = None,
            idle_timeout: float | None = None) -> Result:
        from invoke.exceptions import CommandTimedOut

        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout

        def timed_out() -> RemoteError:
            return RemoteError(self.host.name, command, None, "", reason=f"timed out after {timeout} s")

        def go(conn: Any) -> Result:
            started = time.monotonic()
            activity = _Activity()
            watchdog = _Watchdog(conn, activity, idle_timeout) if idle_timeout else None
            try:
                # hide=False only so that output reaches `activity` as it comes; it is captured all the same
                r = conn.run(command, timeout=timeout, hide=False, out_stream=activity, err_stream=activity)
            except CommandTimedOut:
                raise timed_out() from None
            finally:
                if watchdog is not None:
                    watchdog.stop()
            if watchdog is not None and watchdog.fired:
                raise _ConnectionLost(self.host.name, f"no answer for {idle_timeout:g} s while the command ran "
                                      "(the link went dark?)")
            if r.exited == -1:  # no exit status came back
                if timeout is not None and time.monotonic() - started >= timeout:
                    # invoke's timer closed the channel, but its thread had not ended when the result
                    # was made, so invoke did not raise CommandTimedOut itself
                    raise timed_out()
                if self._lost(conn):
                    raise _ConnectionLost(
                        self.host.name,
                        "connection lost while the command ran; it may or may not have finished",
                    )
            return Result(self.host.name, command, r.exited, r.stdout, r.stderr)

        result = self._call(go)
        return result.check() if check else result

    def _session(self, conn: Any) -> Any:
        """The connection's SFTP session, opened at its first use and kept with it; its channel takes the
        same large window and packets as a streamed command's. Called holding `_sftp_lock`."""
        import paramiko

        if self._sftp is None or self._sftp[0] is not conn:
            client = paramiko.SFTPClient.from_transport(conn.transport, window_size=STREAM_WINDOW,
                                                        max_packet_size=STREAM_PACKET)
            if client is None:
                raise paramiko.SSHException("the host offers no SFTP session")
            client.get_channel().settimeout(DEFAULT_TIMEOUT_S)  # a host gone silent fails the call, never hangs it
            self._sftp, self._sftp_piece = (conn, client), 0
        return self._sftp[1]

    def _lost_sftp(self, conn: Any) -> None:
        """A file transfer failed on the link itself: the connection (and its session) is made anew."""
        with self._lock:
            self._drop(conn)

    def _refused(self, what: str, exc: OSError) -> RemoteError:
        """The host's SFTP server said no (a permission, a full disk): its answer, not a link to retry."""
        return RemoteError(self.host.name, what, None, "", reason=exc.strerror or str(exc))

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None:
        target = self.expand(path)

        def go(conn: Any) -> None:
            with self._sftp_lock:
                sftp = self._session(conn)
                # A name nobody can guess, created only if absent (O_EXCL): a symlink planted at a fixed
                # temporary name would redirect the write. Its mode is set before any byte is written.
                tmp = f"{target}.{secrets.token_hex(8)}.tmp"
                try:
                    _make_folders(sftp, posixpath.dirname(target))
                    with sftp.open(tmp, "wx") as f:
                        f.chmod(mode)
                        f.set_pipelined(True)  # writes go out without waiting on each answer; close checks them
                        write_pieces(f.write, data, target)
                    sftp.posix_rename(tmp, target)
                except BaseException as exc:
                    with contextlib.suppress(Exception):
                        sftp.remove(tmp)
                    if isinstance(exc, OSError) and exc.errno is not None and conn.is_connected:
                        raise self._refused(f"sftp put {target}", exc) from None
                    raise

        self._call(go)

    def open_file(self, path: str) -> RemoteFile:
        target = self.expand(path)

        def go(conn: Any) -> RemoteFile:
            self._sftp_lock.acquire()
            try:
                sftp = self._session(conn)
                # SFTP opens through a symlink, so the name is looked at first (lstat) and the open file
                # again (fstat): a symlink, a FIFO or a device there is never read. (A link swapped in
                # between the two is read only when it leads to a plain file.)
                try:
                    if not stat.S_ISREG(sftp.lstat(target).st_mode or 0):
                        raise FileNotFoundError(f"no plain file at {target}")
                    f = sftp.open(target, "rb")
                except OSError as exc:
                    if isinstance(exc, FileNotFoundError) or exc.errno == errno.ENOENT:
                        raise FileNotFoundError(f"no plain file at {target}") from None
                    if exc.errno is not None and conn.is_connected:
                        raise self._refused(f"sftp read {target}", exc) from None
                    raise
                st = f.stat()
                if not stat.S_ISREG(st.st_mode or 0):
                    f.close()
                    raise FileNotFoundError(f"no plain file at {target}")
                return _SFTPFile(self, conn, f, st.st_size or 0, stat.S_IMODE(st.st_mode or 0o600),
                                 self._sftp_lock.release)
            except BaseException:
                self._sftp_lock.release()
                raise

        result: RemoteFile = self._call(go)
        return result

    def stream(self, command: str) -> Stream:
        def go(conn: Any) -> Stream:
            channel = conn.transport.open_session(timeout=DEFAULT_TIMEOUT_S, window_size=STREAM_WINDOW,
                                                  max_packet_size=STREAM_PACKET)
            channel.exec_command(command)
            return _ChannelStream(channel)

        return self._call(go)

    def hold_open(self, wake_s: float = 1.0) -> None:
        """For a connection held for hours (a host's watcher): paramiko's thread looks at its keepalive every
        `wake_s` instead of ten times a second, which was most of an idle watcher's CPU."""
        transport = self._conn.transport if self._conn is not None else None
        if transport is not None and transport.sock is not None:
            transport.sock.settimeout(wake_s)

    @staticmethod
    def _lost(conn: Any, grace: float = 0.5) -> bool:
        """Whether the connection is gone. Exit status -1 means none came back: the command died of a
        signal, or the connection dropped; paramiko closes the channel just before it marks the
        transport inactive, hence the short grace."""
        deadline = time.monotonic() + grace
        while conn.is_connected and time.monotonic() < deadline:
            time.sleep(0.01)
        return not conn.is_connected

    def close(self) -> None:
        # a thread still connecting to a host that does not answer holds the lock: leave it behind
        if not self._lock.acquire(timeout=1):
            return
        try:
            self._drop()
        finally:
            self._lock.release()


def _make_folders(sftp: Any, folder: str) -> None:
    """`mkdir -p` over SFTP: each missing folder of the path made in turn (one that exists, as a folder or
    a symlink to one, is left as it is)."""
    if not folder or folder == "/":
        return
    try:
        sftp.stat(folder)
        return
    except FileNotFoundError:
        pass
    _make_folders(sftp, posixpath.dirname(folder))
    try:
        sftp.mkdir(folder)
    except OSError:
        if not stat.S_ISDIR(sftp.stat(folder).st_mode or 0):  # made meanwhile by someone else: fine
            raise
