"""bench/gpu_check.py's readings, with the tests-only nvidia-smi stand-in (tests/fakes) on PATH: the script
that checks orch on a lent GPU machine must tell agreement from disagreement before it goes there."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from orchtest import Orch

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"
UUID = "GPU-4e9e74b7-4977-f04d-3af3-ccfe5f570e90"


def load_check() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = load_check()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen]:
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sleeper: subprocess.Popen) -> dict[str, Any]:
    """One GPU with the sleeper holding 4096 MiB of it, as the stand-in shows it."""
    path = tmp_path / "gpu-state.json"
    doc = {"gpus": [{"index": 0, "uuid": UUID, "memory_total": 81559, "utilization": 7}],
           "processes": [{"pid": sleeper.pid, "gpu": 0, "used_memory": 4096}]}
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("ORCH_FAKE_GPU_STATE", str(path))
    return doc


def orch_gpus(tmp_path: Path) -> dict[str, Any]:
    return json.loads(Orch(tmp_path / "ws")("gpus", "--json", check=0).stdout)


def test_orch_gpus_agrees_with_nvidia_smi(tmp_path: Path, state: dict[str, Any], sleeper: subprocess.Popen) -> None:
    seen = check.smi()
    assert seen["gpus"] == {UUID: {"index": 0, "used": 4099, "total": 81559}}
    assert seen["apps"] == [{"pid": sleeper.pid, "uuid": UUID, "used": 4096}]
    assert check.compare(orch_gpus(tmp_path), seen) == []


def test_each_disagreement_is_named(tmp_path: Path, state: dict[str, Any], sleeper: subprocess.Popen) -> None:
    doc = orch_gpus(tmp_path)
    seen = check.smi()
    gpu = doc["local"]["gpus"][0]
    gpu["memory_used_mib"] += check.SLACK_MIB + 1
    gpu["processes"] = []
    problems = check.compare(doc, seen)
    assert problems == [f"GPU 0: orch used {4099 + check.SLACK_MIB + 1} MiB, nvidia-smi 4099",
                        f"processes: orch [], nvidia-smi [({sleeper.pid}, '{UUID}')]"]
    doc["local"]["gpus"] = []
    assert check.compare(doc, seen)[0] == f"GPUs: orch [], nvidia-smi ['{UUID}']"
    assert check.compare({"local": {"ok": True, "nvidia_smi": False}}, seen)[0].startswith("orch gpus: ok=True")


def test_a_holder_is_found_by_its_memory(state: dict[str, Any], sleeper: subprocess.Popen) -> None:
    seen = check.smi()
    assert check.holder(seen, 4096, set())["pid"] == sleeper.pid
    assert check.holder(seen, 4096, {sleeper.pid}) is None  # not new
    assert check.holder(seen, 8192, set()) is None  # not that big


def test_the_holder_enters_itself_in_the_stand_in(tmp_path: Path, state: dict[str, Any]) -> None:
    path = os.environ["ORCH_FAKE_GPU_STATE"]
    p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--hold", "2048", "--fake-state", path],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "holding 2048 MiB\n"
        seen = check.smi()
        assert check.total_used(seen) == 3 + 4096 + 2048
        assert check.holder(seen, 2048, {a["pid"] for a in state["processes"]})["pid"] == p.pid
    finally:
        p.kill()
        p.wait()
    assert check.total_used(check.smi()) == 3 + 4096  # gone with its process, as on a GPU
