"""Patch sets inside runs: checked before anything, applied before launch, reverted after the end."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from orchtest import FAST, Orch

from orchestrator.store import Store

pytest_plugins = ["engine_src"]  # engine_source, engine, engine_python: real sglang 0.5.23 source

EMULATOR = Path(__file__).parent / "fakes" / "sglang_emulator.py"
DEBUG = "sglang-eagle3-hidden-debug"
NO_GRAPHS = ["--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled"]


def serve_cmd(*flags: str) -> str:
    argv = [sys.executable, str(EMULATOR), "--shards", "3", "--shard-time", "0.01", *flags]
    return "cmd=" + " ".join(shlex.quote(a) for a in argv)


def workspace(tmp_path: Path, fleet, python: str) -> Orch:
    return Orch(tmp_path / "ws", fleet.hosts_toml(test1={"workdir": str(tmp_path / "r1"), "python": python}))


def test_run_applies_then_reverts_byte_for_byte(tmp_path, ssh_fleet, engine):
    orch = workspace(tmp_path, ssh_fleet, engine.python)
    before = engine.snapshot("sglang")
    res = orch("run", "command", "--host", "test1", "--set", serve_cmd(*NO_GRAPHS),
               "--set", f'patches=["{DEBUG}"]', "--set", "engine=sglang", *FAST)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    patch_events = [e["message"] for e in doc["events"] if e["kind"] == "patch"]
    assert patch_events[0].startswith(f"{DEBUG} on sglang 0.5.23:") and "applied" in patch_events[0]
    assert "reverted" in patch_events[1]
    assert engine.snapshot("sglang") == before
    status = orch("patch", "status", "--host", "test1", "--json", check=0).stdout
    assert DEBUG not in status


def test_missing_required_flags_refuse_the_run_before_anything(tmp_path, ssh_fleet, engine):
    orch = workspace(tmp_path, ssh_fleet, engine.python)
    before = engine.snapshot("sglang")
    res = orch("run", "command", "--host", "test1", "--set", serve_cmd(), "--set", f'patches=["{DEBUG}"]', *FAST)
    assert res.returncode == 2
    assert "--cuda-graph-backend-decode=disabled" in res.stderr and len(res.stderr.splitlines()) == 1
    assert orch.status() == [] and not (tmp_path / "r1").exists()
    assert engine.snapshot("sglang") == before


def test_a_set_that_does_not_apply_changes_nothing(tmp_path, ssh_fleet, engine):
    orch = workspace(tmp_path, ssh_fleet, engine.python)
    target = engine.path("sglang/srt/models/llama_eagle3.py")
    text = target.read_text()
    edited = "        hidden_states = forward_batch.spec_info.hidden_states  # edited by hand\n"
    target.write_text(text.replace("        hidden_states = forward_batch.spec_info.hidden_states\n", edited, 1))
    assert target.read_text() != text
    before = engine.snapshot("sglang")
    res = orch("run", "command", "--host", "test1", "--set", serve_cmd(*NO_GRAPHS),
               "--set", f'patches=["{DEBUG}"]', *FAST)
    assert res.returncode == 2
    assert "llama_eagle3.py" in res.stderr and "hunk" in res.stderr
    assert engine.snapshot("sglang") == before
    doc = orch.status(1)
    assert doc["status"] == "failed" and doc["pid"] is None and "does not apply" in doc["reason"]


def test_unknown_patch_set_is_bad_input(tmp_path, ssh_fleet):
    orch = workspace(tmp_path, ssh_fleet, sys.executable)
    res = orch("run", "command", "--set", "cmd=true", "--set", 'patches=["nope"]')
    assert res.returncode == 2 and "nope" in res.stderr


def test_the_specs_python_is_the_one_patched_reverted_and_reported(tmp_path, ssh_fleet, engine, other_engine):
    """The host's python is one venv; the run's spec names another: the sets follow the spec's."""
    orch = workspace(tmp_path, ssh_fleet, engine.python)
    host_install, other_install = engine.snapshot("sglang"), other_engine.snapshot("sglang")
    res = orch("run", "command", "--host", "test1", "--set", serve_cmd(*NO_GRAPHS), "--set", "engine=sglang",
               "--set", f'patches=["{DEBUG}"]', "--set", f"python={other_engine.python}", *FAST)
    assert res.returncode == 0, res.stderr
    applied, reverted = [e for e in orch.status(1)["events"] if e["kind"] == "patch"]
    assert f"for {other_engine.python}" in applied["message"] and "reverted" in reverted["message"]
    store = Store(orch.db)
    records = store.patch_records("test1")
    store.close()
    assert [r["action"] for r in records] == ["apply"] * 3 + ["revert"] * 3
    assert {r["path"].startswith(f"{other_engine.site}/") for r in records} == {True}
    assert (engine.snapshot("sglang"), other_engine.snapshot("sglang")) == (host_install, other_install)

    # orch patch --python reaches that install, and only that one.
    flag = ["--host", "test1", "--python", other_engine.python]
    orch("patch", "apply", DEBUG, *flag, check=0)
    assert other_engine.snapshot("sglang") != other_install and engine.snapshot("sglang") == host_install
    assert "pristine" in orch("patch", "check", DEBUG, "--host", "test1", check=0).stdout
    assert "already" in orch("patch", "check", DEBUG, *flag, check=0).stdout
    [entry] = json.loads(orch("patch", "status", *flag, "--json", check=0).stdout)
    assert entry["root"] == str(other_engine.site) and entry["intact"]
    assert json.loads(orch("patch", "status", "--host", "test1", "--json", check=0).stdout) == []
    orch("patch", "revert", DEBUG, *flag, check=0)
    assert other_engine.snapshot("sglang") == other_install
