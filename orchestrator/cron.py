"""Nightly sweeps from the user's crontab.

Each entry is one self-sufficient line: cron gives it a bare environment (`/bin/sh`, PATH=/usr/bin:/bin,
no ORCH_HOME), so the line carries absolute paths, the workspace and a PATH that finds `orch`. Entries
are tagged with the comment `orch:<id>`; list and remove never touch anything else in the crontab.

The line calls `orch cron fire ID FILE`, which holds an flock on `runs/cron/<key>.lock` while the sweep
runs; a night whose previous sweep still holds it skips, and says so in `runs/cron/<key>.log` (the key
is the file's name and a hash of its absolute path, so sweeps of the same name in two folders never
share them). It runs
the sweep with the local date of the firing as its instance: an unchanged file is a new sweep every night,
and firing again the same night (after a crash) resumes that night's sweep.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .config.checks import unprintable
from .config.workspace import Workspace
from .errors import NotFound, OrchError, UsageError

TAG = "orch:"
CRON_PATH = "/usr/local/bin:/usr/bin:/bin"  # appended after the interpreter's bin dir
CRONTAB_ENV = "ORCH_CRONTAB"  # a tab file to edit instead of the user's crontab


@dataclass
class Entry:
    id: str
    schedule: str
    file: str | None
    workspace: str | None
    log: str | None
    enabled: bool
    command: str
    next_run: float | None = None  # epoch seconds, local time's schedule
    last_run: dict[str, Any] | None = None  # from the entry's log: started, ended, result

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sweep_key(file: Path) -> str:
    """The name of a sweep's lock and log: its file name without suffix, made safe for a path, and a
    hash of its absolute path, so two `hs.toml` in different folders never meet."""
    path = Path(file).resolve()
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem) or "sweep"
    return f"{name}-{hashlib.sha256(str(path).encode()).hexdigest()[:8]}"


def cron_dir(ws: Workspace) -> Path:
    return ws.runs_dir / "cron"


def _tab() -> Any:
    """The crontab orch edits: the user's (through the `crontab` program), or the tab file named by
    $ORCH_CRONTAB, in the same format (installed with `crontab FILE`, or kept by configuration management)."""
    from crontab import CronTab

    tabfile = os.environ.get(CRONTAB_ENV)
    try:
        if not tabfile:
            return CronTab(user=True)
        if not os.path.exists(tabfile):  # nothing installed yet: written on the first install
            tab = CronTab(tab="")
            tab.filen = tabfile
            return tab
        return CronTab(tabfile=tabfile)
    except (OSError, ValueError) as exc:  # no `crontab` binary, or a crontab it cannot read
        raise UsageError(f"cannot read the crontab{f' {tabfile}' if tabfile else ''}: {exc}") from None


def _write(tab: Any) -> None:
    try:
        tab.write()
    except OSError as exc:
        raise OrchError(f"cannot write the crontab: {exc}") from None


def check_schedule(at: str) -> str:
    from crontab import CronSlices

    at = " ".join(at.split())
    if not at or not CronSlices.is_valid(at):
        raise UsageError(f"invalid cron schedule {at!r} (expected five fields, e.g. '0 2 * * *', or @daily)")
    return at


def check_sweep_file(file: Path) -> Path:
    """The sweep file must exist and parse, so a typo is found now rather than at 2 am."""
    from . import sweep

    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"sweep file not found: {file}")
    sweep.load(path)  # a UsageError naming the problem
    return path


def orch_argv() -> list[str]:
    """How cron starts this same orch: the `orch` script next to the interpreter, else `python -m`."""
    script = Path(sys.executable).parent / "orch"
    if script.is_file() and os.access(script, os.X_OK):
        return ["orch"]
    return [sys.executable, "-P", "-m", "orchestrator"]  # -P: the folder cron starts in imports nothing


def check_one_line(ws: Workspace, file: Path) -> None:
    """Every path the line carries must keep it one line: cron (and python-crontab reading it back)
    splits on newlines, which quoting does not protect, so a path holding one would add entries."""
    for what, path in (("the sweep file's path", file), ("ORCH_HOME", ws.root), ("the --hosts path", ws.hosts_file),
                       ("the interpreter's path", Path(sys.executable)), ("orch's source path", Path(__file__))):
        char = unprintable(str(path))
        if char:
            raise UsageError(f"{what} {str(path)!a} holds a control character ({char}); "
                             "a crontab line cannot carry it")


def cron_command(ws: Workspace, entry_id: str, file: Path) -> str:
    check_one_line(ws, file)
    log = cron_dir(ws) / f"{sweep_key(file)}.log"
    bindir = str(Path(sys.executable).parent)
    # cron turns an unescaped % into a newline before the shell sees the line; python-crontab escapes every
    # % of the command as it writes the line, so the words are only shell-quoted here
    env = [f"ORCH_HOME={shlex.quote(str(ws.root))}", f"PATH={shlex.quote(bindir + ':' + CRON_PATH)}"]
    if orch_argv()[0] != "orch":  # running from a source tree: the package must be importable
        env.append(f"PYTHONPATH={shlex.quote(str(Path(__file__).resolve().parent.parent))}")
    argv = [*orch_argv()]
    if ws.hosts_file != ws.root / "hosts.toml":
        argv += ["--hosts", str(ws.hosts_file)]
    argv += ["cron", "fire", entry_id, str(file)]
    return (
        f"cd {shlex.quote(str(ws.root))} && {' '.join(env)} {' '.join(shlex.quote(a) for a in argv)}"
        f" >> {shlex.quote(str(log))} 2>&1"
    )


def _entry(job: Any) -> Entry:
    words = _words(job.command)
    file = words[words.index("fire") + 2] if "fire" in words and len(words) > words.index("fire") + 2 else None
    home = next((w.split("=", 1)[1] for w in words if w.startswith("ORCH_HOME=")), None)
    log = words[words.index(">>") + 1] if ">>" in words and len(words) > words.index(">>") + 1 else None
    return Entry(
        id=job.comment[len(TAG):],
        schedule=str(job.slices),
        file=file,
        workspace=home,
        log=log,
        enabled=bool(job.is_enabled()),
        command=job.command,
    )


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command.replace("\\%", "%"))
    except ValueError:
        return command.split()


def _orch_jobs(tab: Any) -> list[Any]:
    return [job for job in tab if (job.comment or "").startswith(TAG)]


def install(ws: Workspace, file: Path, at: str, dry_run: bool = False) -> Entry:
    """Add a crontab line that runs the sweep at `at`; validates everything before touching the crontab.

    The same file on the same schedule twice is refused (it would run the sweep twice a night); with
    dry_run the entry is returned without writing anything.
    """
    schedule = check_schedule(at)
    path = check_sweep_file(file)
    check_one_line(ws, path)
    tab = _tab()
    jobs = _orch_jobs(tab)
    for job in jobs:
        other = _entry(job)
        if other.file == str(path) and _same_schedule(other.schedule, schedule):
            raise UsageError(f"cron entry {other.id} already runs {path} at {other.schedule!r} "
                             f"(`orch cron remove {other.id}` first)")
    taken = {job.comment[len(TAG):] for job in jobs}
    entry_id = secrets.token_hex(3)
    while entry_id in taken:
        entry_id = secrets.token_hex(3)
    if not dry_run:
        cron_dir(ws).mkdir(parents=True, exist_ok=True)
    job = tab.new(command=cron_command(ws, entry_id, path), comment=TAG + entry_id)
    job.setall(schedule)
    if not dry_run:
        _write(tab)
    return _entry(job)


def _same_schedule(a: str, b: str) -> bool:
    from crontab import CronSlices

    return str(CronSlices(a)) == str(CronSlices(b))


def entries(now: float | None = None) -> list[Entry]:
    """orch's entries, each with its next run and what its last firing came to."""
    found = []
    for job in _orch_jobs(_tab()):
        entry = _entry(job)
        entry.next_run = _next_run(job, now)
        entry.last_run = last_run(Path(entry.log), entry.id) if entry.log else None
        found.append(entry)
    return found


def _next_run(job: Any, now: float | None) -> float | None:
    from datetime import datetime

    try:
        when = job.schedule(date_from=datetime.fromtimestamp(time.time() if now is None else now)).get_next()
    except (ImportError, ValueError, KeyError):  # a schedule croniter cannot iterate (@reboot)
        return None
    return float(when.timestamp())


_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) orch:(\w+) (start|end|skipped)(?::? ?)(.*)$")


def last_run(log: Path, entry_id: str) -> dict[str, Any] | None:
    """The entry's last firing from its log: when it started (and ended) and its result — succeeded,
    failed (exit N), skipped (the previous sweep still ran) or running."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    last: dict[str, Any] | None = None
    for line in lines:
        m = _LOG_LINE.match(line)
        if not m or m.group(2) != entry_id:
            continue
        at, what, rest = m.group(1), m.group(3), m.group(4)
        if what == "start":
            last = {"started": at, "ended": None, "result": "running"}
        elif what == "skipped":
            last = {"started": at, "ended": at, "result": "skipped: " + rest.removeprefix(": ")}
        elif last is not None:
            code = rest.rsplit(" ", 1)[-1]
            last.update(ended=at, result="succeeded" if code == "0" else f"failed (exit {code})")
    return last


def remove(entry_id: str) -> Entry:
    tab = _tab()
    jobs = [job for job in _orch_jobs(tab) if job.comment == TAG + entry_id]
    if not jobs:
        raise NotFound(f"no orch cron entry {entry_id!r} (see `orch cron list`)")
    entry = _entry(jobs[0])
    for job in jobs:
        tab.remove(job)
    _write(tab)
    return entry


def _log(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


def _record_skip(entry_id: str, file: Path, message: str) -> None:
    """An event for the skip on the sweep still running."""
    from . import sweep
    from .store import StoreError

    try:
        sweep.record_cron_skip(entry_id, file, message)
    except (OrchError, StoreError) as exc:  # the log line already says what happened
        sys.stderr.write(f"orch: could not record the skip as an event: {exc}\n")


def fire(ws: Workspace, entry_id: str, file: Path,
         start: Callable[[list[str], int], int] | None = None, instance: str | None = None) -> int:
    """Run the sweep under the lock; skip (exit 0) when the previous night's sweep still holds it.
    The sweep's instance is `instance`, by default the local date now."""
    path = Path(file).resolve()
    instance = time.strftime("%Y-%m-%d") if instance is None else instance
    folder = cron_dir(ws)
    folder.mkdir(parents=True, exist_ok=True)
    key = sweep_key(path)
    log, lock = folder / f"{key}.log", folder / f"{key}.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            message = f"skipped: the previous sweep of {path} still runs (pid {holder})"
            _log(log, f"orch:{entry_id} {message}")
            _record_skip(entry_id, path, message)
            return 0
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _log(log, f"orch:{entry_id} start: sweep {path} instance {instance}")
        argv = [*orch_argv(), *(["--hosts", str(ws.hosts_file)] if ws.hosts_file != ws.root / "hosts.toml"
                                else []), "sweep", "run", str(path),
                "--instance", instance]
        code = (start or _start)(argv, fd)
        _log(log, f"orch:{entry_id} end: exit code {code}")
        return code
    finally:
        os.close(fd)


def _start(argv: list[str], lock_fd: int) -> int:
    # The sweep inherits the locked descriptor: the lock lasts as long as the sweep, even if this
    # process is killed first.
    if argv[0] == "orch":
        argv = [sys.executable, "-P", "-m", "orchestrator", *argv[1:]]
    return subprocess.call(argv, pass_fds=(lock_fd,), stdin=subprocess.DEVNULL)
