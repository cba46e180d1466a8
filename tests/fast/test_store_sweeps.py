"""The sweep tables through the store: JSON columns written and read there, so callers see Python values,
and one damaged column does not stop a sweep's status."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import sweep
from orchestrator.errors import NotFound
from orchestrator.store import Store
from orchestrator.store import sweeps as stored_sweeps
from orchestrator.sweep import db


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "orch.db")
    yield s
    s.close()


def make(store: Store) -> int:
    return stored_sweeps.create(
        store, name="grid", file_hash="h", instance="", path="/grid.toml", playbook="command",
        doc={"name": "grid", "objective": {"metric": "tok_s", "goal": "max"}, "retry_backoff_s": float("inf")},
        notify=["https://example.invalid/hook"], status="queued",
        points=[{"index": 0, "point": '{"tp": 1}', "host": "a", "gpus": [0, 1], "status": "queued"},
                {"index": 1, "point": '{"tp": 2}', "host": "b", "gpus": None, "status": "queued"}])


def test_json_columns_come_back_as_values(store: Store) -> None:
    sweep_id = make(store)
    row = stored_sweeps.sweep(store, sweep_id)
    assert row is not None
    # strict JSON only: an infinity is stored as null, which every reader can read
    assert row["doc"] == {"name": "grid", "objective": {"metric": "tok_s", "goal": "max"}, "retry_backoff_s": None}
    assert row["notify"] == ["https://example.invalid/hook"]
    points = db.points(store, sweep_id)
    assert [(p.key, p.diff, p.gpus) for p in points] == [('{"tp": 1}', {"tp": 1}, [0, 1]),
                                                          ('{"tp": 2}', {"tp": 2}, None)]
    stored_sweeps.add_event(store, sweep_id, "note", "hello", {"point": 0, "why": ["a"]})
    assert [(e["kind"], e["data"]) for e in stored_sweeps.events(store, sweep_id)][-1] == ("note", {"point": 0, "why": ["a"]})
    assert sweep.document(store, sweep_id)["objective"] == {"metric": "tok_s", "goal": "max"}


def test_a_damaged_column_reads_as_missing_and_the_status_still_shows(store: Store) -> None:
    sweep_id = make(store)
    with store.tx() as c:  # what a crash or a hand edit may leave
        c.execute("UPDATE sweeps SET doc = '{not json', notify = 'nan' WHERE id = ?", (sweep_id,))
        c.execute("UPDATE sweep_points SET gpus = '[0,', point = 'x' WHERE sweep_id = ? AND idx = 0", (sweep_id,))
    doc = sweep.document(store, sweep_id)
    assert doc["objective"] is None and doc["notify"] == []
    assert [(p["index"], p["point"], p["gpus"]) for p in doc["points"]] == [(0, {}, None), (1, {"tp": 2}, None)]


def test_no_such_sweep_is_none_then_not_found(store: Store) -> None:
    assert stored_sweeps.sweep(store, 7) is None
    with pytest.raises(NotFound, match="no sweep 7"):
        db.sweep(store, 7)
