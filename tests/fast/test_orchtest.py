"""`Orch` runs a prompt command in the test's process as a new interpreter would find it, and leaves the
process as it was."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from orchtest import IMPORTED_CONSOLES, Orch, runs_in_process

from orchestrator.cli import render
from orchestrator.host import session


def test_which_commands_run_in_process() -> None:
    assert runs_in_process(("status", "--json")) and runs_in_process(("--hosts", "h.toml", "logs", "3"))
    assert runs_in_process(("sweep", "status")) and runs_in_process(("cron", "list"))
    assert runs_in_process(("sweep", "run", "s.toml"))
    assert runs_in_process(("cron", "install", "s.toml")) and runs_in_process(("cron", "remove", "1"))
    for args in (("run", "command", "--detach"), ("rerun", "1"), ("watch", "1"), ("cancel", "1"), ("stop", "1")):
        assert runs_in_process(args), args  # a run's watcher is a process of its own all the same
    for args in (("watch", "1", "--background"), ("logs", "3", "-f"), ("status", "--refresh"),
                 ("cron", "fire", "1", "s.toml"), ("ssh", "1"), ("ui",), ("--version",), ()):
        assert not runs_in_process(args), args


def test_a_call_past_its_timeout_raises_as_a_process_would(tmp_path: Path) -> None:
    import signal
    import subprocess

    with pytest.raises(subprocess.TimeoutExpired):  # the alarm goes off within the call's first steps
        Orch(tmp_path / "ws")("status", "--json", timeout=0.000001)
    assert signal.getsignal(signal.SIGALRM) is signal.SIG_DFL and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert Orch(tmp_path / "ws")("status", "--json").returncode == 0  # the process as it was


def test_a_call_has_the_orchs_environment_and_gives_this_process_its_own_back(tmp_path: Path) -> None:
    a, b = Orch(tmp_path / "a"), Orch(tmp_path / "b")
    before, streams, held = dict(os.environ), (sys.stdout, sys.stderr), session.current()
    a.env["NO_SUCH_VARIABLE_HERE"] = "1"
    res = a("status", "--json")
    assert res.returncode == 0 and json.loads(res.stdout) == []
    assert str(tmp_path / "a") in res.stderr  # "no runs here": the workspace is a's ORCH_HOME
    assert str(tmp_path / "b") in b("status").stderr
    assert dict(os.environ) == before and (sys.stdout, sys.stderr) == streams and session.current() is held


def test_bad_input_is_exit_2_and_one_line_on_stderr(tmp_path: Path) -> None:
    res = Orch(tmp_path / "ws")("status", "nope")
    assert (res.returncode, res.stdout, res.stderr) == (2, "", "orch: not a run id: 'nope'\n")


def test_the_consoles_are_the_calls_own_and_a_tests_own_console_stays(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    orch = Orch(tmp_path / "ws")
    assert orch("playbooks").stdout.startswith("name\t")  # a pipe's tab-separated lines, not a table
    orch("status")  # its module may be imported during the call, taking the call's consoles
    status = sys.modules["orchestrator.cli.status"]
    assert (render.out, render.err) == IMPORTED_CONSOLES  # put back, in every module that holds them
    assert (status.out, status.err) == IMPORTED_CONSOLES
    from rich.console import Console

    mine = Console(record=True, width=100)
    monkeypatch.setattr(render, "out", mine)
    orch("status")
    assert render.out is mine


def test_no_two_test_files_share_a_name() -> None:
    # pytest imports test files by their base name (no packages here): a second file of the same name in
    # another folder is not collected, and its tests silently never run
    names = [p.name for p in Path(__file__).resolve().parents[1].rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_a_ctrl_c_a_call_took_as_detach_stops_the_tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    import orchestrator.cli

    def detached(args: list[str]) -> None:  # what `run` does on a Ctrl-C while it follows a run
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise SystemExit(0)

    monkeypatch.setattr(orchestrator.cli, "main", detached)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        Orch(tmp_path / "ws")("run", "command")
    assert signal.getsignal(signal.SIGINT) is before
