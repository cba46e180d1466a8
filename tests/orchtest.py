"""Helpers for tests that drive the real `orch` command in a workspace of their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TESTS = Path(__file__).parent
JOB = TESTS / "jobs" / "progress_job.py"
FAST = ["--set", "poll_min=0.05", "--set", "poll_max=0.3"]


class Orch:
    """An `orch` workspace (ORCH_HOME) and a way to run the CLI in it as a separate process."""

    def __init__(self, root: Path, hosts_toml: str = ""):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        (root / "hosts.toml").write_text(hosts_toml)
        self.env = {**os.environ, "ORCH_HOME": str(root), "COLUMNS": "200"}

    def __call__(self, *args: str, timeout: float = 120, check: int | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator", *args],
            env=self.env, capture_output=True, text=True, timeout=timeout,
        )
        if check is not None:
            assert proc.returncode == check, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def spawn(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *args],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def status(self, run_id: int | None = None) -> Any:
        args = ["status", "--json"] + ([str(run_id)] if run_id is not None else [])
        return json.loads(self(*args, check=0).stdout)

    def wait_for(self, run_id: int, predicate: Any, timeout: float = 60) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            doc = self.status(run_id)
            if predicate(doc):
                return doc
            time.sleep(0.1)
        raise AssertionError(f"run {run_id} never reached the expected state: {doc}")

    @property
    def db(self) -> Path:
        return self.root / "runs" / "orch.db"


def in_process(capsys: Any) -> Any:
    """`orch ARGS` run in this process (Typer's app, no interpreter start): (exit code, stdout, stderr)."""
    from orchestrator.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
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
    starts it (`python -m orchestrator.runflow.hostwatch NAME`)."""
    return (b"orchestrator" in argv and b"--background" in argv) or b"orchestrator.runflow.hostwatch" in argv


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
