"""Real engine sources for the patch tests: sglang 0.5.23 and speculators 0.3.0 in a throwaway venv, and
speculators 0.4.0.1 in one of its own (one venv holds one version of a package).

The wheels are installed with `--no-deps`: the patcher only needs to find the packages and read their
versions and files, never to import them (which would need torch and CUDA). The venv is built once per
machine under ORCH_ENGINE_SRC_CACHE (default /tmp/orch-engine-src) and never modified: every test
session works on its own copy, and every test gets the patched files of that copy restored afterwards.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.runflow.registry import patch_sets

ENGINE_REQUIREMENTS = ("sglang==0.5.23", "speculators==0.3.0")
SPECULATORS_04 = ("speculators==0.4.0.1",)
CACHE_ROOT = Path(os.environ.get("ORCH_ENGINE_SRC_CACHE", "/tmp/orch-engine-src"))
READY = ".orch-complete"


def site_packages(venv_dir: Path) -> Path:
    return venv_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _key(requirements: tuple[str, ...]) -> str:
    """The cache key: the wheels are for this interpreter's version, so it is part of it."""
    text = sys.version + "\n" + "\n".join(requirements)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _build(target: Path, requirements: tuple[str, ...]) -> None:
    # No pip inside: the test environment's pip installs into the venv's site-packages with
    # --target, so the venv stays small and its python finds both packages on its own sys.path.
    venv.EnvBuilder(with_pip=False, symlinks=True).create(target)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
         "--disable-pip-version-check", "--target", str(site_packages(target)), *requirements],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"installing {' '.join(requirements)} failed:\n{proc.stdout}{proc.stderr}")
    (target / READY).write_text("\n".join(requirements) + "\n")


def engine_venv(requirements: tuple[str, ...] = ENGINE_REQUIREMENTS) -> Path:
    """The cached pristine venv, built on first use (under a lock, so parallel sessions build it once)."""
    key = _key(requirements)
    target = CACHE_ROOT / f"venv-{key}"
    if (target / READY).exists():
        return target
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(CACHE_ROOT / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / READY).exists():
            building = CACHE_ROOT / f"venv-{key}.building"
            shutil.rmtree(building, ignore_errors=True)
            _build(building, requirements)
            shutil.rmtree(target, ignore_errors=True)
            building.rename(target)  # the venv's python finds site-packages relative to itself
    return target


class EngineSource:
    """A private copy of the engine venv; `restore()` copies files back from the pristine cache."""

    def __init__(self, root: Path, requirements: tuple[str, ...] = ENGINE_REQUIREMENTS):
        self.pristine = engine_venv(requirements)
        self.root = root
        if not (root / READY).exists():
            shutil.copytree(self.pristine, root, symlinks=True, dirs_exist_ok=True)

    @property
    def python(self) -> str:
        return str(self.root / "bin" / "python")

    @property
    def site(self) -> Path:
        return site_packages(self.root)

    def path(self, relpath: str) -> Path:
        return self.site / relpath

    def snapshot(self, package: str) -> dict[str, str]:
        """sha256 of every file of an installed package, by path inside it."""
        return snapshot(self.site / package)

    def restore(self, relpaths: list[str]) -> None:
        """Put back the cached bytes (and times) of these files, e.g. after a test left them patched."""
        for relpath in relpaths:
            if (site_packages(self.pristine) / relpath).exists():  # a set for another engine: not in this venv
                shutil.copy2(site_packages(self.pristine) / relpath, self.path(relpath))


def snapshot(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory`, by relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def engine_source(tmp_path_factory: pytest.TempPathFactory) -> EngineSource:
    return EngineSource(tmp_path_factory.mktemp("engine") / "venv")


@pytest.fixture
def engine(engine_source: EngineSource) -> Iterator[EngineSource]:
    """The session's engine copy, restored to the pristine sources after the test."""
    yield engine_source
    engine_source.restore(sorted({f for ps in patch_sets() for f in ps.files}))


@pytest.fixture(scope="session")
def other_engine_source(tmp_path_factory: pytest.TempPathFactory) -> EngineSource:
    return EngineSource(tmp_path_factory.mktemp("engine-other") / "venv")


@pytest.fixture
def other_engine(other_engine_source: EngineSource) -> Iterator[EngineSource]:
    """A second install on the same host (a venv of its own), as a vLLM venv beside an SGLang one."""
    yield other_engine_source
    other_engine_source.restore(sorted({f for ps in patch_sets() for f in ps.files}))


@pytest.fixture(scope="session")
def speculators_04_source(tmp_path_factory: pytest.TempPathFactory) -> EngineSource:
    return EngineSource(tmp_path_factory.mktemp("engine-spec04") / "venv", SPECULATORS_04)


@pytest.fixture
def speculators_04(speculators_04_source: EngineSource) -> Iterator[EngineSource]:
    """A venv whose site-packages hold the real speculators 0.4.0.1, restored after the test."""
    yield speculators_04_source
    speculators_04_source.restore(sorted({f for ps in patch_sets() for f in ps.files if f.startswith("speculators/")}))


@pytest.fixture
def engine_python(engine: EngineSource) -> str:
    """Path of a python whose site-packages hold the real sglang 0.5.23 and speculators 0.3.0."""
    return engine.python
