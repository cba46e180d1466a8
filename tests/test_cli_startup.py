"""orch builds only the command it runs: `orch status` imports neither the other commands' modules nor what
only they need (pydantic, the watchers), while help, completion and bad input meet every command as before.
What is imported, not how long it takes: bench/status_startup.py measures the start-up."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from orchtest import in_process
from typer import _click as click

from orchestrator.cli.app import COMMAND_MODULES, app
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status

ROOT = Path(__file__).resolve().parent.parent
OTHER_COMMANDS = {f"orchestrator.cli.{module}" for module in set(COMMAND_MODULES.values()) - {"status"}}
ONLY_OTHERS_NEED = {"pydantic", "orchestrator.config.hosts", "orchestrator.runflow.watching", "orchestrator.runflow",
                    "orchestrator.sweep", "orchestrator.ui", "orchestrator.runflow.registry"}
# orch in a fresh interpreter, as the console script runs it; then the modules it imported, on stderr
ORCH = """
import json, sys
from orchestrator.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
sys.stderr.write("\\nimported: " + json.dumps(sorted(sys.modules)))
"""


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """A workspace with one run, ended (so nothing is to be watched)."""
    (tmp_path / "hosts.toml").write_text("")
    store = Store(tmp_path / "runs" / "orch.db")
    run_id = store.create_run("command", "local", {"cmd": "true"})
    for status in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING, Status.SUCCEEDED):
        transition(store, run_id, status)
    store.close()
    return tmp_path


def orch(ws: Path, *args: str) -> tuple[str, set[str]]:
    """stdout of `orch ARGS`, and the modules it imported."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "ORCH_HOME": str(ws), "PYTHONPATH": path, "COLUMNS": "120"}
    proc = subprocess.run([sys.executable, "-c", ORCH, *args], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return proc.stdout, set(json.loads(proc.stderr.rsplit("imported: ", 1)[1]))


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["status", "1", "--json"]])
def test_status_imports_no_other_command(ws: Path, args: list[str]) -> None:
    out, imported = orch(ws, *args)
    assert "succeeded" in out  # it did show the run
    assert "orchestrator.cli.status" in imported
    assert imported & OTHER_COMMANDS == set()
    assert imported & ONLY_OTHERS_NEED == set()


def test_a_command_imports_its_own_module_and_help_imports_them_all(ws: Path) -> None:
    _, imported = orch(ws, "sweep", "status", "--json")
    assert imported & OTHER_COMMANDS == {"orchestrator.cli.sweeps"}
    shown, imported = orch(ws, "--help")
    assert OTHER_COMMANDS <= imported
    rows = shown.split("Commands", 1)[1].splitlines()
    listed = [line.split()[1] for line in rows if line.startswith("│ ") and line[2] != " "]
    assert listed == [name for name in COMMAND_MODULES if name != "watch-host"]  # hidden, as before


def test_every_command_is_in_the_table_with_its_module() -> None:
    """A command declared in a module the table does not name would be missing from orch."""
    for module in set(COMMAND_MODULES.values()):
        importlib.import_module(f"orchestrator.cli.{module}")
    declared = {(info.name or typer.main.get_command_name(info.callback.__name__)): info.callback.__module__
                for info in app.registered_commands if info.callback is not None}
    for group in app.registered_groups:
        assert group.typer_instance is not None and group.name is not None
        first = group.typer_instance.registered_commands[0].callback
        assert first is not None
        declared[group.name] = first.__module__
    assert declared == {name: f"orchestrator.cli.{module}" for name, module in COMMAND_MODULES.items()}


def commands(command: click.Command, path: str = "orch") -> Iterator[tuple[str, click.Command]]:
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, f"{path} {name}")


def outcome(parse: Callable[..., Any], param: click.Parameter, ctx: click.Context, value: Any) -> Any:
    try:
        parsed = parse(param, ctx, value)
        return "value", parsed, type(parsed)
    except (click.exceptions.ClickException, typer.Exit) as exc:
        return "error", type(exc), str(exc)


def test_a_value_with_nothing_to_parse_comes_out_as_typer_parses_it() -> None:
    """Every parameter of every command, not given, at its default, and (text) as typed: the same value, or
    the same error, as Typer's own parsing gives."""
    root = typer.main.get_command(app)
    checked = 0
    for path, command in commands(root):
        run = click.Context(command, info_name=path)
        for param in command.get_params(run):
            values = [None, param.default]
            if param.type_descriptor.annotation is str:  # type: ignore[attr-defined]
                values += ["gpu01", "", "٣"]
            parse = type(param).process_value  # type: ignore[attr-defined]
            for value in values:
                assert outcome(parse, param, run, value) == outcome(parse.__wrapped__, param, run, value), \
                    f"{path} {param.name} {value!r}"
                checked += 1
    assert checked > 300


def test_bad_input_is_still_one_message_and_exit_2(capsys: pytest.CaptureFixture[str], ws: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_HOME", str(ws))
    run = in_process(capsys)
    code, _, err = run("status", "--limit", "abc")
    assert code == 2 and "Invalid value for '--limit' / '-n'" in err
    code, _, err = run("statu")
    assert code == 2 and "No such command 'statu'. Did you mean 'status'?" in err
    code, _, err = run("status", "--status", "bogus")
    assert code == 2 and "'bogus' is not one of" in err
    code, out, _ = run("status", "--status", "succeeded", "--json", "-n", "5")
    assert code == 0 and [doc["status"] for doc in json.loads(out)] == ["succeeded"]


def test_the_lean_entry_point_loads_no_cli() -> None:
    code = ("import sys, orchestrator.watch.hostwatch; "
            "print(sorted(m for m in ('typer', 'rich', 'click', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
