"""Fixtures of the in-process tests."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from orchtest import in_process

from orchestrator.runflow import watching
from orchestrator.store import Store


@pytest.fixture(scope="session")
def migrated_database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A database made by Store once, every migration applied (closed: one file, no WAL beside it)."""
    path = tmp_path_factory.mktemp("migrated") / "orch.db"
    Store(path).close()
    return path


@pytest.fixture(autouse=True)
def new_databases_are_copies(migrated_database: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Store opened where no database is yet opens a copy of the migrated one: applying every migration
    to an empty file takes longer than most of these tests (tests/test_store.py migrates for real, as
    does every `orch` started as a process)."""
    opening = Store.__init__

    def open_a_copy(self: Store, path: Path | str, *args: Any, **kwargs: Any) -> None:
        if str(path) != ":memory:" and not Path(path).exists():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(migrated_database, path)
        opening(self, path, *args, **kwargs)

    monkeypatch.setattr(Store, "__init__", open_a_copy)


@pytest.fixture
def records_orch(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """`orch ARGS` in process, (exit code, stdout, stderr), on a workspace whose runs the test writes to the
    store itself (`records_store`), with the test module's HOSTS as its hosts.toml: nothing is watched."""
    monkeypatch.setenv("ORCH_HOME", str(tmp_path))
    (tmp_path / "hosts.toml").write_text(getattr(request.module, "HOSTS", ""))
    monkeypatch.setattr(watching, "ensure_watched", lambda *a, **k: [])
    return in_process(capsys)


@pytest.fixture
def records_store(tmp_path: Path) -> Store:
    """The database of `records_orch`'s workspace."""
    return Store(tmp_path / "runs" / "orch.db")
