"""What every way of running commands on a host offers: `run` a shell command, `put` a file; and the
local one. Every value placed into a command goes through `quote`."""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..config.hosts import Host
from ..errors import RemoteError

quote = shlex.quote

DEFAULT_TIMEOUT_S = 120.0  # a call given no timeout of its own: a host that stops answering never hangs orch


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


class Transport:
    """Runs shell commands on one host. Subclasses: LocalTransport, SSHTransport."""

    host: Host

    def run(self, command: str, *, check: bool = True, timeout: float | None = None,
            idle_timeout: float | None = None) -> Result:
        """Run a shell command; `timeout` bounds the whole call (default DEFAULT_TIMEOUT_S), `idle_timeout`
        the silence between two pieces of output (a command that writes a byte now and then while it
        waits: its silence means the link went dark)."""
        raise NotImplementedError

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None:
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
                ["bash", "-c", command], capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
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
                f.write(data)
            tmp.replace(target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def stream(self, command: str) -> Stream:
        proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        return _ProcessStream(proc)
