"""The patcher as an op of the agent: the package looked for where the host's python finds it when it runs a
job, on a path of folders rather than the agent's own (isolated) sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator.host.hostjobs import patcher


def installed(site: Path, name: str, version: str) -> Path:
    (site / name).mkdir(parents=True)
    (site / name / "__init__.py").write_text("")
    meta = site / f"{name}-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return site


def test_a_package_is_found_on_the_path_given_with_its_version(tmp_path: Path) -> None:
    first = installed(tmp_path / "first", "enginex", "0.5.23")
    second = installed(tmp_path / "second", "enginex", "0.4.0")
    assert patcher.find_package("enginex", None, [str(first), str(second)]) == (str(first), "0.5.23")
    assert patcher.find_package("enginex", None, [str(second), str(first)]) == (str(second), "0.4.0")
    with pytest.raises(patcher.PatchFailure, match="package enginex is not installed"):
        patcher.find_package("enginex", None, [str(tmp_path / "empty")])
    with pytest.raises(patcher.PatchFailure, match="no installed distribution other-dist"):
        patcher.find_package("enginex", "other-dist", [str(first)])


def test_a_package_installed_after_the_agent_looked_is_found(tmp_path: Path) -> None:
    """The agent lives long: a folder it looked in before is looked at again."""
    site = tmp_path / "site"
    site.mkdir()
    with pytest.raises(patcher.PatchFailure):
        patcher.find_package("latecomer", None, [str(site)])
    installed(site, "latecomer", "1.0")
    assert patcher.find_package("latecomer", None, [str(site)]) == (str(site), "1.0")


def test_the_search_path_is_the_jobs_pythonpath_then_the_pythons_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/opt/first:relative:/opt/second")
    monkeypatch.setenv("PYTHONNOUSERSITE", "1")
    path = patcher.search_path()
    assert path[:2] == ["/opt/first", "/opt/second"] and "relative" not in path
    assert path[2:] == [p for p in sys.path if p.startswith("/")]
    monkeypatch.delenv("PYTHONPATH")
    assert patcher.search_path() == [p for p in sys.path if p.startswith("/")]
