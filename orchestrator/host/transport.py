"""What every way of running commands on a host offers: `run` a shell command, `put` a file, `open_file`
to read one; and the local one. Every value placed into a command goes through `quote`."""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import stat
import subprocess
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from ..config.hosts import Host
from ..config.workspace import user_umask
from ..errors import RemoteError
from . import session

quote = shlex.quote

DEFAULT_TIMEOUT_S = 120.0  # a call given no timeout of its own: a host that stops answering never hangs orch
LARGE_UPLOAD = 8 << 20  # an upload this big is shown as it goes; a smaller one is over in a blink



def metered(what: str, total: int) -> AbstractContextManager[Callable[[int], object]]:
    """The context that counts a transfer's bytes: the session's `transfer_meter`, or one that shows nothing."""
    transfer_meter = session.current().transfer_meter
    if transfer_meter is None:
        return contextlib.nullcontext(_unseen)
    return transfer_meter(what, total)


def _unseen(n: int) -> None:
    pass


@dataclass
class Result:
    host: str
    command: str
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self) -> Result:
        if not self.ok:
            raise RemoteError(self.host, self.command, self.exit_code, self.stdout + self.stderr)
        return self


def env_exports(env: dict[str, str]) -> str:
    """`export K=V` lines; names are validated identifiers, values are quoted."""
    for key in env:
        if not key.isidentifier():
            raise ValueError(f"not an environment variable name: {key!r}")
    return "".join(f"export {k}={quote(str(v))}\n" for k, v in env.items())


class Stream:
    """Both ends of a long-lived command: bytes to its stdin, bytes from its stdout."""

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def recv(self, n: int) -> bytes:
        """Up to n bytes as they come; b"" once the command's output ended."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _ProcessStream(Stream):
    def __init__(self, proc: subprocess.Popen[bytes]):
        self.proc = proc

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise EOFError("the command's input is closed") from exc

    def recv(self, n: int) -> bytes:
        assert self.proc.stdout is not None
        try:
            return self.proc.stdout.read1(n)  # type: ignore[attr-defined]  # a BufferedReader
        except ValueError:  # closed by close() from another thread
            return b""

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RemoteFile:
    """A plain file on a host, open for reading; its bytes as they were up to `size`, its length when opened
    (bytes appended later are not read: a log that grows as it is read still ends), and its permission bits
    on the host (`mode`: a copy keeps them)."""

    size: int
    mode: int = 0o600

    def read(self, n: int) -> bytes:
        """Up to n bytes (at least one while any are left); b"" at the end."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _LocalFile(RemoteFile):
    def __init__(self, fd: int, size: int, mode: int):
        self._file = os.fdopen(fd, "rb")
        self.size, self._left, self.mode = size, size, mode

    def read(self, n: int) -> bytes:
        data = self._file.read(min(n, self._left)) if self._left > 0 else b""
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._file.close()


class Transport:
    """Runs shell commands on one host, and moves files to and from it. Subclasses: LocalTransport,
    SSHTransport."""

    host: Host

    def run(self, command: str, *, check: bool = True, timeout: float | None = None,
            idle_timeout: float | None = None) -> Result:
        """Run a shell command; `timeout` bounds the whole call (default DEFAULT_TIMEOUT_S), `idle_timeout`
        the silence between two pieces of output (a command that writes a byte now and then while it
        waits: its silence means the link went dark)."""
        raise NotImplementedError

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None:
        """Write `data` to `path` (its folders made as needed): a fresh name renamed into place, so a
        symlink at `path` is replaced, never written through. A large one is shown by `transfer_meter`."""
        raise NotImplementedError

    def open_file(self, path: str) -> RemoteFile:
        """A plain file on the host, open for reading. Anything else at `path` (nothing, a folder, a
        symlink, which is never followed) raises FileNotFoundError."""
        raise NotImplementedError

    def stream(self, command: str) -> Stream:
        """Start a long-lived command whose stdin and stdout are a byte stream (its stderr is dropped)."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def home(self) -> str:
        if not hasattr(self, "_home"):
            self._home = self.run('printf %s "$HOME"').stdout
        return self._home

    def expand(self, path: str) -> str:
        """Expand a leading ~ on the host, since quoting stops the remote shell from doing it."""
        if path == "~" or path.startswith("~/"):
            return self.home() + path[1:]
        return path


class LocalTransport(Transport):
    def __init__(self, host: Host):
        self.host = host

    def run(self, command: str, *, check: bool = True, timeout: float | None = None,
            idle_timeout: float | None = None) -> Result:
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        try:
            proc = subprocess.run(
                ["bash", "-c", command], capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False,
                umask=_job_umask(),
            )
        except subprocess.TimeoutExpired:
            raise RemoteError(self.host.name, command, None, "", reason=f"timed out after {timeout} s")
        result = Result(
            self.host.name,
            command,
            proc.returncode,
            proc.stdout.decode(errors="replace"),
            proc.stderr.decode(errors="replace"),
        )
        return result.check() if check else result

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None:
        target = Path(self.expand(path))
        target.parent.mkdir(parents=True, exist_ok=True)
        # As over SFTP: a fresh name that cannot be guessed, created only if absent and never through a
        # symlink, its mode set before the data; then renamed over the target (a symlink there is replaced).
        tmp = target.with_name(f"{target.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), mode)
                write_pieces(f.write, data, str(target))
            tmp.replace(target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def open_file(self, path: str) -> RemoteFile:
        try:
            # O_NOFOLLOW: a symlink is refused by the open itself; O_NONBLOCK: a FIFO never hangs the open
            fd = os.open(self.expand(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise FileNotFoundError(f"no plain file at {path}: {exc.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise FileNotFoundError(f"no plain file at {path}")
        return _LocalFile(fd, st.st_size, stat.S_IMODE(st.st_mode))

    def stream(self, command: str) -> Stream:
        proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, umask=_job_umask())
        return _ProcessStream(proc)


def _job_umask() -> int:
    """The umask of what orch starts on this machine (its agent, and so the jobs): the user's own, not the
    owner-only one orch writes its workspace with (-1: as this process's)."""
    umask = user_umask()
    return -1 if umask is None else umask


def write_pieces(write: Callable[[bytes], Any], data: bytes, path: str, piece: int = 1 << 20) -> None:
    """Hand `data` to `write` a piece at a time, a large upload shown by `transfer_meter` as it goes."""
    if len(data) < LARGE_UPLOAD:
        write(data)
        return
    with metered(f"upload {os.path.basename(path)}", len(data)) as advance:
        for at in range(0, len(data), piece):
            chunk = data[at:at + piece]
            write(chunk)
            advance(len(chunk))
