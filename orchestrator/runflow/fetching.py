"""Getting a run's files back from its host: the whole log streamed, the run dir pulled, a shell there."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config.hosts import Host
from ..errors import OrchError, UsageError
from ..host import agent
from ..host.remote import Transport, quote
from .context import Context

CHUNK = 1 << 20  # bytes per round trip: a long log never sits whole in memory, here or in one reply
PULL_LIMIT = 1 << 30  # default bound on what `orch pull` copies


def read_chunks(transport: Transport, path: str, write: Callable[[bytes], object], chunk: int = CHUNK,
                max_bytes: int | None = None) -> int:
    """Write a remote file's bytes in chunks (raw over the wire, after each reply's line), at
    most `max_bytes` of them; the number of bytes written. A symlink reads as empty: a file swapped for
    one (to /dev/zero, say) is never followed."""
    offset = 0
    while max_bytes is None or offset < max_bytes:
        want = chunk if max_bytes is None else min(chunk, max_bytes - offset)
        reply = agent.call(transport, "chunk", timeout=300, path=path, offset=offset, length=want)
        data = agent.data_of(reply)
        write(data)
        offset += len(data)
        if len(data) < want:
            break
    return offset


def stream_log(ctx: Context, write: Callable[[bytes], None]) -> int:
    """The run's whole log, from its first byte, chunk by chunk."""
    if not ctx.store.get_run(ctx.run_id).remote_dir:
        raise OrchError(f"run {ctx.run_id} has no log: it never reached its host")
    return read_chunks(ctx.transport, ctx.paths.log, write)


@dataclass
class Pulled:
    to: Path
    files: int
    size: int


def pull(ctx: Context, to: Path, limit: int = PULL_LIMIT) -> Pulled:
    """Copy the run's remote dir (log, outputs manifest, whatever the job left there) into `to`;
    refused whole, before any copy, when it holds more than `limit` bytes."""
    root = ctx.paths.root
    # size and path of each plain file; a `pulled/` inside is an earlier pull (the local host's run dir is
    # the local artifacts' dir)
    listing = agent.call(ctx.transport, "files", timeout=120, dir=root, skip="pulled")["files"]
    files = [(int(size), str(name)) for size, name in listing]
    total = sum(size for size, _ in files)
    if total > limit:
        raise UsageError(f"run {ctx.run_id}'s dir {ctx.host.name}:{root} holds {_size(total)} in {len(files)} files,"
                         f" more than --max-size {_size(limit)}; raise it, or copy what you need with scp")
    for size, name in files:
        target = to / name
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as f:  # as listed: a file that grew or was swapped since adds nothing
            read_chunks(ctx.transport, f"{root}/{name}", f.write, max_bytes=size)
    return Pulled(to, len(files), total)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def parse_size(text: str) -> int:
    """`512M`, `2G`, `800K` or a number of bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = (text[:-1], text[-1].upper()) if text[-1:].isalpha() else (text, "")
    if unit not in units or not number.isdigit():
        raise UsageError(f"not a size: {text!r} (e.g. 512M, 2G)")
    return int(number) * units[unit]


def ssh_command(host: Host, remote_dir: str, command: str | None = None) -> list[str]:
    """The `ssh` line that opens a login shell in `remote_dir` (or runs `command` there), from the host's
    inventory entry; every value is its own argument, and the remote line is quoted for the remote shell."""
    if host.on_this_machine:
        raise UsageError(f"the run is on this machine ({host.name}): cd {quote(remote_dir)}")
    argv = ["ssh"] + ([] if command else ["-t"])
    if host.port:
        argv += ["-p", str(host.port)]
    if host.identity_file:
        argv += ["-i", str(Path(host.identity_file).expanduser())]
    if host.known_hosts:
        argv += ["-o", f'UserKnownHostsFile=~/.ssh/known_hosts "{Path(host.known_hosts).expanduser()}"']
    if host.accept_new_host_key:
        argv += ["-o", "StrictHostKeyChecking=accept-new"]
    argv += ["-o", f"ConnectTimeout={host.connect_timeout:g}"]
    address = host.address or host.name
    argv += ["--", f"{host.user}@{address}" if host.user else address]  # `--`: an address is never an option
    argv.append(f"cd {quote(remote_dir)} && " + (command if command else "exec $SHELL -l"))
    return argv


def shell_line(argv: list[str]) -> str:
    return shlex.join(argv)
