"""Helpers for tests that drive the real `orch` command in a workspace of their own."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from orchestrator.cli import render

TESTS = Path(__file__).parent
JOB = TESTS / "jobs" / "progress_job.py"
FAST = ["--set", "poll_min=0.05", "--set", "poll_max=0.3"]
ASK_AGAIN_S = 1.0  # Orch.wait_for asks `orch status` at least this often, the database changed or not

# The commands `Orch` runs in the test's own process (an interpreter start costs more than most of them):
# those that return promptly, and those that start, follow or end runs (run, rerun, watch, cancel, stop, sweep
# run): a host's watcher, the only process that ends a launched run, is always a process of its own
# (runflow/watching.py starts it), so a run started here is watched as a user's is. The test's process
# stands for the command's while it runs (the run's starter, its lease's holder); a test of what happens
# when that process dies or gets a signal starts it with `Orch.spawn` (or `new_process=True`). Any command
# line these do not name gets an interpreter of its own.
IN_PROCESS = {"status", "inspect-log", "compare", "logs", "pull", "hosts", "gpus", "playbooks", "note", "tag",
              "rm", "gc", "patch", "run", "rerun", "watch", "cancel", "stop"}
IN_PROCESS_SUBCOMMANDS = {"sweep": {"run", "status", "report"}, "cron": {"list", "install", "remove"}}
# In a process of their own all the same: `orch logs -f` follows the job until it ends; `orch status
# --refresh` polls the runs, and a poll names its process as the run's watcher (alive, as long as the
# tests run, where the command's own process would be gone); `--background` is a watcher, which runs until
# its runs end
OWN_PROCESS_OPTIONS = {"logs": {"-f", "--follow"}, "status": {"--refresh"}, "watch": {"--background"}}


def runs_in_process(args: tuple[str, ...]) -> bool:
    """Whether `orch ARGS` is one of the commands `Orch` runs in this process (see IN_PROCESS)."""
    rest = list(args)
    while rest and rest[0] == "--hosts" and len(rest) > 1 or rest and rest[0].startswith("--hosts="):
        del rest[:1 if "=" in rest[0] else 2]
    if not rest:
        return False
    command, sub = rest[0], rest[1] if len(rest) > 1 else None
    if command in IN_PROCESS_SUBCOMMANDS:
        return sub in IN_PROCESS_SUBCOMMANDS[command]
    return command in IN_PROCESS and not OWN_PROCESS_OPTIONS.get(command, set()) & set(rest)


# The consoles orchestrator.cli.render made at its import; a call in this process gets a pair of its own
# (made under the call's environment, writing to its captured output) in their place. A console a test
# put there itself stays.
IMPORTED_CONSOLES = (render.out, render.err)


def _orchestrator_modules() -> list[Any]:
    return [m for name, m in list(sys.modules.items()) if name.startswith("orchestrator.") and m is not None]


def _replace_consoles(replacing: dict[int, Any]) -> None:
    """In every module of orchestrator (those imported during a call too), `out`/`err` that is one of the
    keys (by id) becomes its value."""
    for module in _orchestrator_modules():
        for name in ("out", "err"):
            now = module.__dict__.get(name)
            if id(now) in replacing:
                setattr(module, name, replacing[id(now)])


# The process state's entry-point scans (orchestrator/state.py), kept from one call in this process to the next:
# each scan reads every installed package's metadata, the most of what a short command costs here.
SCANS = ("playbook_targets", "run_table_targets")
_SCANNED: dict[str, Any] = {}


@contextlib.contextmanager
def _as_a_new_process(env: dict[str, str]) -> Iterator[tuple[io.TextIOWrapper, io.TextIOWrapper]]:
    """What a call in this process must find as a new interpreter would: the Orch's environment, stdout and
    stderr of its own (bytes, as a pipe takes them), fresh consoles, and a fresh process state (orchestrator/
    state.py: plugins found anew, and none of the connections, agent links, Slurm queues or options an
    earlier call, or the test itself, left). All of it is put back afterwards."""
    from orchestrator import state

    saved_env, saved_streams = dict(os.environ), (sys.stdout, sys.stderr)
    # as a pipe takes them: stdout strict UTF-8, stderr with backslash escapes; written through, so text and
    # bytes written to .buffer keep their order
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    stderr = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)
    os.environ.clear()
    os.environ.update(env)
    sys.stdout, sys.stderr = stdout, stderr
    fresh = render.consoles()  # made now: this environment, these streams
    _replace_consoles({id(old): new for old, new in zip(IMPORTED_CONSOLES, fresh)})
    try:
        with state.fresh() as held:
            # what a scan of the installed packages found: this interpreter's packages never change under it
            # (a test that installs one sets PYTHONPATH, which only a new interpreter runs with)
            for name, found in _SCANNED.items():
                setattr(held, name, found)
            try:
                yield stdout, stderr
            finally:
                _SCANNED.update({name: getattr(held, name) for name in SCANS if getattr(held, name) is not None})
    finally:
        _replace_consoles({id(new): old for old, new in zip(IMPORTED_CONSOLES, fresh)})
        sys.stdout, sys.stderr = saved_streams
        os.environ.clear()
        os.environ.update(saved_env)


def _text(stream: io.TextIOWrapper) -> str:
    """What subprocess.run(text=True) makes of the bytes: decoded, universal newlines."""
    stream.flush()
    data = stream.buffer.getvalue().decode()  # type: ignore[attr-defined]
    return data.replace("\r\n", "\n").replace("\r", "\n")


class _TimedOut(BaseException):
    """The in-process call ran past its timeout (a BaseException: nothing in orch catches it on the way)."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """subprocess.run's `timeout` for a call in this (main) thread: TimeoutExpired once it runs past it."""

    def expired(signum: int, frame: Any) -> None:
        raise _TimedOut

    before = signal.signal(signal.SIGALRM, expired)
    try:  # set inside: an alarm that goes off at once still finds the handler put back
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def run_in_process(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`orch ARGS` through orchestrator.cli.main in this process, as `python -m orchestrator ARGS` would
    run it with `env`: its exit code, stdout and stderr; a traceback and exit 1 for an uncaught exception;
    subprocess.TimeoutExpired past `timeout` seconds, as subprocess.run raises it."""
    from orchestrator.cli import main

    timed_out, sigint = False, signal.getsignal(signal.SIGINT)
    with _as_a_new_process(env) as (stdout, stderr):
        try:
            with _time_limit(timeout):
                main(args)
            code = 0
        except SystemExit as exc:  # as the interpreter takes it: None is 0, any other non-int a message and 1
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except _TimedOut:
            timed_out, code = True, -signal.SIGKILL
        except Exception:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
            traceback.print_exc()
            code = 1
    if signal.getsignal(signal.SIGINT) is not sigint:
        # `run` and `watch` take a Ctrl-C as "detach" and ignore any after it: this process's Ctrl-C was a
        # person stopping the tests, who gets pytest's handler back and the stop they asked for
        signal.signal(signal.SIGINT, sigint)
        raise KeyboardInterrupt
    if timed_out:
        raise subprocess.TimeoutExpired(["orch", *args], timeout, _text(stdout), _text(stderr))
    return subprocess.CompletedProcess(["orch", *args], code, _text(stdout), _text(stderr))


class Orch:
    """An `orch` workspace (ORCH_HOME) and a way to run the CLI in it: a command that returns promptly in
    this process (see IN_PROCESS), any other in an interpreter of its own, both from this process's
    working directory with `env`."""

    def __init__(self, root: Path, hosts_toml: str = ""):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        (root / "hosts.toml").write_text(hosts_toml)
        self.env = {**os.environ, "ORCH_HOME": str(root), "COLUMNS": "200"}

    def __call__(self, *args: str, timeout: float = 120, check: int | None = None,
                 new_process: bool = False) -> subprocess.CompletedProcess:
        """`orch ARGS`; `new_process` for a test of the real entry point (`python -m orchestrator`)."""
        # os.environ and sys.stdout are the process's: a call from another thread gets a process of its own
        elsewhere = threading.current_thread() is not threading.main_thread()
        if new_process or elsewhere or not runs_in_process(args) or self._interpreter_env_differs():
            proc = subprocess.run(
                [sys.executable, "-m", "orchestrator", *args],
                env=self.env, capture_output=True, text=True, timeout=timeout, check=False,
            )
        else:
            proc = run_in_process(list(args), self.env, timeout)
        if check is not None:
            assert proc.returncode == check, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def _interpreter_env_differs(self) -> bool:
        """An environment that changes the interpreter itself (PYTHONPATH: another package installed) is
        only a new interpreter's."""
        return any(self.env.get(k) != os.environ.get(k) for k in {*self.env, *os.environ} if k.startswith("PYTHON"))

    def spawn(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *args],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def status(self, run_id: int | None = None) -> Any:
        args = ["status", "--json"] + ([str(run_id)] if run_id is not None else [])
        return json.loads(self(*args, check=0).stdout)

    def wait_for(self, run_id: int, predicate: Any, timeout: float = 60) -> dict:
        """`orch status RUN` until `predicate` holds of it. Looked at every 0.1 s, but asked again only once the
        database changed, or ASK_AGAIN_S after it was last asked (for what status shows beside the database, and
        what asking does: a dead watcher replaced). A call costs tens of milliseconds of CPU; a look, two stats."""
        deadline = time.time() + timeout
        seen, asked, doc = None, 0.0, None
        while True:
            now, stamp = time.time(), self._db_stamp()
            if stamp != seen or now - asked >= ASK_AGAIN_S:
                seen, asked = stamp, now  # taken before asking: a change during the call is asked about next
                doc = self.status(run_id)
                if predicate(doc):
                    return doc
            if now >= deadline:
                raise AssertionError(f"run {run_id} never reached the expected state: {doc}")
            time.sleep(0.1)

    def _db_stamp(self) -> tuple[tuple[int, int], ...]:
        """When the database and its write-ahead log last changed, and their sizes: a commit changes one."""
        stamps = []
        for path in (self.db, self.db.with_name(self.db.name + "-wal")):
            try:
                st = path.stat()
                stamps.append((st.st_mtime_ns, st.st_size))
            except OSError:
                stamps.append((0, 0))
        return tuple(stamps)

    def wait_finished(self, run_id: int, timeout: float = 120) -> dict:
        """The run once every end step has begun: those before its release are over by then (the stop of what
        lingered of its job, the log's last read, the patch revert), the lease freed."""
        from orchestrator.runflow import END_STEPS

        return self.wait_for(run_id, lambda d: set(d["end_steps"]) >= set(END_STEPS), timeout)

    @property
    def db(self) -> Path:
        return self.root / "runs" / "orch.db"


def in_process(capsys: Any) -> Any:
    """`orch ARGS` run in this process (Typer's app, no interpreter start), each call with a process state of
    its own (orchestrator/state.py), as a new process would have: (exit code, stdout, stderr)."""
    from orchestrator import state
    from orchestrator.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            with state.fresh():
                main(list(args))
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        got = capsys.readouterr()
        return code, got.out, got.err

    return run


def fleet_toml(fleet: Any, **overrides: Any) -> str:
    return fleet.hosts_toml(**overrides)


def job_cmd(*args: str) -> str:
    """A `cmd=` value running the test job with this interpreter (paths quoted for bash)."""
    import shlex

    return "cmd=" + " ".join(shlex.quote(a) for a in (sys.executable, str(JOB), *args))


def wait_for_file(path: Path, timeout: float = 60) -> None:
    """Until a job touches its marker (the job's own signal that it reached a point)."""
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def kill_controller(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def reached(path: Path, timeout: float = 60) -> None:
    """Until a job held with `--pause AT:path` (the test job, the engine emulator) is waiting there."""
    wait_for_file(Path(f"{path}.reached"), timeout)


def release(path: Path) -> None:
    """Let a job held at `path` go on."""
    path.touch()


def _orch_watcher(argv: list[bytes]) -> bool:
    """`orch watch ID --background` / `orch watch-host NAME --background`, or a host's watcher as orch
    starts it (`python -m orchestrator.watch.hostwatch NAME`)."""
    return (b"orchestrator" in argv and b"--background" in argv) or b"orchestrator.watch.hostwatch" in argv


def stop_background_watchers(home: Path, timeout: float = 30) -> None:
    """Kill -9 the background watchers started with this HOME (a test's runs it did not end, or a test
    that kills whoever watches its run); returns once they are gone."""
    marker = f"HOME={home}".encode()
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not _orch_watcher((proc / "cmdline").read_bytes().split(b"\0")):
                continue
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
        except OSError:
            continue  # gone meanwhile, or not ours to read
    deadline = time.time() + timeout
    for pid in killed:
        while alive(pid):
            assert time.time() < deadline, f"watcher {pid} outlived kill -9"
            time.sleep(0.02)


def processes_of(root: Path, needle: str) -> list[str]:
    """Command lines of the live processes that run `needle` (a path, a word) for this test only: those
    whose command line, working directory or environment names `root` (the test's tmp_path). Another
    test's processes, in another worker beside this one, are not its business."""
    mine = str(root).encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            raw = (proc / "cmdline").read_bytes()
            if needle.encode() not in raw or not alive(int(proc.name)):
                continue
            cwd = os.readlink(proc / "cwd").encode()
            if mine in raw or cwd.startswith(mine) or mine in (proc / "environ").read_bytes():
                found.append(raw.replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    """Alive and not a zombie (nothing may reap orphans in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> str:
    """A process's command line, its words joined by spaces ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def processes(marker: str) -> dict[int, str]:
    """Live processes whose command line holds `marker`, with it (network namespaces share this pid space)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and marker in (line := cmdline(int(entry))) and alive(int(entry)):
            found[int(entry)] = line
    return found


def agent_ops(monkeypatch: Any) -> list[str]:
    """The ops this process asks hosts' agents for through `agent.call`, in order, from now on."""
    from orchestrator.host import agent

    ops: list[str] = []
    asked = agent.call

    def counting(transport: Any, op: str, timeout: float = 60, **args: Any) -> Any:
        ops.append(op)
        return asked(transport, op, timeout, **args)

    monkeypatch.setattr(agent, "call", counting)
    return ops
