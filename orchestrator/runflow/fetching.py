"""Getting a run's files back from its host: the whole log streamed, the run dir pulled (both over the
host's SFTP session, or plain files on this machine), a shell there."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..config.hosts import Host
from ..errors import OrchError, UsageError
from ..host import agent
from ..host.remote import quote
from ..host.transport import RemoteFile, metered
from .context import Run

CHUNK = 1 << 20  # bytes handed on at a time: a long log never sits whole in memory
PULL_LIMIT = 1 << 30  # default bound on what `orch pull` copies


def copy_file(source: RemoteFile, write: Callable[[bytes], object], most: int | None = None,
              advance: Callable[[int], object] | None = None) -> int:
    """Hand on an open file's bytes chunk by chunk, at most `most` of them; the number handed on."""
    done = 0
    while most is None or done < most:
        data = source.read(CHUNK if most is None else min(CHUNK, most - done))
        if not data:
            break
        write(data)
        done += len(data)
        if advance is not None:
            advance(len(data))
    return done


def stream_log(run: Run, write: Callable[[bytes], None]) -> int:
    """The run's whole log, from its first byte, chunk by chunk (over SFTP from a remote host)."""
    if not run.refresh().remote_dir:
        raise OrchError(f"run {run.run_id} has no log: it never reached its host")
    try:
        source = run.transport.open_file(run.paths.log)
    except FileNotFoundError:
        return 0  # not written yet, or not a plain file: nothing to show
    with source:
        return copy_file(source, write)


@dataclass
class Pulled:
    to: Path
    files: int
    size: int


def pull(run: Run, to: Path, limit: int = PULL_LIMIT) -> Pulled:
    """Copy the run's remote dir (log, outputs manifest, whatever the job left there) into `to` over the
    host's SFTP session; refused whole, before any copy, when it holds more than `limit` bytes. Each file
    is copied up to its listed size (one that grew since adds nothing); one gone or swapped for a symlink
    since the listing is left out, the link never followed."""
    root = run.paths.root
    # size and path of each plain file, symlinks left out, in one request to the host's agent; a `pulled/`
    # inside is an earlier pull (the local host's run dir is the local artifacts' dir)
    listing = agent.call(run.transport, "files", timeout=120, dir=root, skip="pulled")["files"]
    files = [(int(size), str(name)) for size, name in listing]
    total = sum(size for size, _ in files)
    if total > limit:
        raise UsageError(f"run {run.run_id}'s dir {run.host.name}:{root} holds {_size(total)} in {len(files)} files,"
                         f" more than --max-size {_size(limit)}; raise it, or copy what you need with scp")
    copied = size_copied = 0
    with metered(f"pull run {run.run_id}", total) as advance:
        for size, name in files:
            try:
                source = run.transport.open_file(f"{root}/{name}")
            except FileNotFoundError:
                continue
            with source:
                target = to / name
                target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                with _create(target, source.mode) as f:
                    size_copied += copy_file(source, f.write, most=size, advance=advance)
            copied += 1
    return Pulled(to, copied, size_copied)


def _create(target: Path, mode: int) -> BinaryIO:
    """A fresh file at `target` (one there before is replaced, never written through a link) with the
    owner's permission bits the host gave it, and none for anyone else: an owner-only job.sh stays so, a
    script stays executable, and a copy of a file others could read there is no one else's here."""
    if target.is_symlink() or target.exists():
        target.unlink()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, mode & 0o700)
    return os.fdopen(fd, "wb")


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
