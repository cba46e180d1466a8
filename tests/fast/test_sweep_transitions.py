"""Sweep and point statuses: every move, allowed or refused, through the one function that writes it."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.errors import OrchError, TransitionError
from orchestrator.store import Store
from orchestrator.store import sweeps as stored_sweeps
from orchestrator.store.controller import Controller
from orchestrator.sweep import db
from orchestrator.sweep.record import POINT_ALLOWED, SWEEP_ALLOWED, Fault, PointStatus, SweepStatus

S, P = SweepStatus, PointStatus

SWEEP_MOVES = {
    (S.QUEUED, S.RUNNING), (S.QUEUED, S.CANCELLED),
    (S.RUNNING, S.SUCCEEDED), (S.RUNNING, S.FAILED), (S.RUNNING, S.CANCELLED),
    (S.SUCCEEDED, S.RUNNING), (S.FAILED, S.RUNNING), (S.CANCELLED, S.RUNNING),  # the file run again
}
POINT_MOVES = {
    (P.QUEUED, P.RUNNING), (P.QUEUED, P.CANCELLED), (P.QUEUED, P.SUCCEEDED), (P.QUEUED, P.FAILED),
    (P.RUNNING, P.QUEUED), (P.RUNNING, P.SUCCEEDED), (P.RUNNING, P.FAILED), (P.RUNNING, P.CANCELLED),
    (P.FAILED, P.QUEUED), (P.CANCELLED, P.QUEUED),
    # a search's: a loser stopped early, a point that broke a bound (from queued: the run had ended)
    (P.QUEUED, P.PRUNED), (P.QUEUED, P.INFEASIBLE), (P.RUNNING, P.PRUNED), (P.RUNNING, P.INFEASIBLE),
}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "orch.db")
    yield s
    s.close()


def make_sweep(store: Store, status: SweepStatus, points: list[tuple[PointStatus, Fault | None]],
               controller: str | None = None) -> int:
    with store.tx() as c:
        sweep_id = int(c.execute(
            "INSERT INTO sweeps (name, file_hash, instance, path, playbook, doc, notify, status, controller,"
            " heartbeat, created_at) VALUES ('s', 'h', '', '/s.toml', 'command', '{}', '[]', ?, ?, ?, ?)",
            (status.value, controller, time.time(), time.time())).lastrowid or 0)
        c.executemany("INSERT INTO sweep_points (sweep_id, idx, point, host, status, fault, attempts)"
                      " VALUES (?, ?, ?, 'h', ?, ?, 0)",
                      [(sweep_id, i, json.dumps({"i": i}), st.value, f.value if f else None)
                       for i, (st, f) in enumerate(points)])
    return sweep_id


def test_the_tables_are_these() -> None:
    assert {(a, b) for a, tos in SWEEP_ALLOWED.items() for b in tos} == SWEEP_MOVES
    assert {(a, b) for a, tos in POINT_ALLOWED.items() for b in tos} == POINT_MOVES
    assert set(SWEEP_ALLOWED) == set(SweepStatus) and set(POINT_ALLOWED) == set(PointStatus)


@pytest.mark.parametrize("current, to", list(itertools.product(SweepStatus, SweepStatus)))
def test_sweep_transition(store: Store, current: SweepStatus, to: SweepStatus) -> None:
    sweep_id = make_sweep(store, current, [])
    if (current, to) in SWEEP_MOVES:
        db.transition_sweep(store, sweep_id, to, "why")
        assert db.sweep(store, sweep_id).status is to
        (event,) = stored_sweeps.events(store, sweep_id)
        assert event["kind"] == "status" and event["message"] == f"{to}: why"
        assert event["data"] == {"from": current.value, "to": to.value}
    else:
        with pytest.raises(TransitionError, match=f"cannot go from {current} to {to}"):
            db.transition_sweep(store, sweep_id, to)
        assert db.sweep(store, sweep_id).status is current and stored_sweeps.events(store, sweep_id) == []


@pytest.mark.parametrize("current, to", list(itertools.product(PointStatus, PointStatus)))
def test_point_transition(store: Store, current: PointStatus, to: PointStatus) -> None:
    sweep_id = make_sweep(store, S.RUNNING, [(current, Fault.SETUP if current is P.FAILED else None)])
    fault = Fault.FLEET if to is P.FAILED else None
    if (current, to) in POINT_MOVES:
        db.transition_point(store, sweep_id, 0, to, reason="why", fault=fault, run_id=7, attempt=True)
        pt = db.point(store, sweep_id, 0)
        assert (pt.status, pt.fault, pt.reason, pt.run_id, pt.attempts) == (to, fault, "why", 7, 1)
        (event,) = stored_sweeps.events(store, sweep_id)
        assert event["kind"] == "point" and event["data"] == {"point": 0, "from": current.value, "to": to.value}
    else:
        with pytest.raises(TransitionError, match=f"point 0 cannot go from {current} to {to}"):
            db.transition_point(store, sweep_id, 0, to, fault=fault, run_id=7)
        pt = db.point(store, sweep_id, 0)
        assert (pt.status, pt.run_id, pt.attempts) == (current, None, 0) and stored_sweeps.events(store, sweep_id) == []


@pytest.mark.parametrize("to, fault", [(P.FAILED, None), (P.QUEUED, Fault.JOB), (P.CANCELLED, Fault.FLEET)])
def test_only_a_failed_point_has_a_fault(store: Store, to: PointStatus, fault: Fault | None) -> None:
    sweep_id = make_sweep(store, S.RUNNING, [(P.RUNNING, None)])
    with pytest.raises(ValueError):
        db.transition_point(store, sweep_id, 0, to, fault=fault)


def test_claim_queues_what_did_not_finish(store: Store) -> None:
    left = [(P.QUEUED, None), (P.RUNNING, None), (P.SUCCEEDED, None), (P.FAILED, Fault.JOB),
            (P.FAILED, Fault.FLEET), (P.FAILED, Fault.SETUP), (P.CANCELLED, None)]
    dead = str(Controller("gpu-box-2", 4242, "777"))  # another machine, its heartbeat long gone
    sweep_id = make_sweep(store, S.RUNNING, left, controller=dead)
    store.conn.execute("UPDATE sweeps SET heartbeat = 0 WHERE id = ?", (sweep_id,))
    db.claim(store, sweep_id)
    row = db.sweep(store, sweep_id)
    assert row.status is S.RUNNING and row.controller is not None and row.controller.is_mine
    assert [(p.status, p.fault) for p in db.points(store, sweep_id)] == [
        (P.QUEUED, None), (P.QUEUED, None), (P.SUCCEEDED, None), (P.FAILED, Fault.JOB),
        (P.QUEUED, None), (P.QUEUED, None), (P.QUEUED, None)]


def test_claim_refuses_a_live_controller(store: Store) -> None:
    alive = str(Controller("gpu-box-2", 4242, "777"))  # another machine, a fresh heartbeat
    sweep_id = make_sweep(store, S.RUNNING, [(P.RUNNING, None)], controller=alive)
    with pytest.raises(OrchError, match="already running \\(controller pid 4242 on gpu-box-2\\)"):
        db.claim(store, sweep_id)
    assert db.point(store, sweep_id, 0).status is P.RUNNING


def test_a_controller_does_not_overwrite_a_cancelled_point(store: Store) -> None:
    sweep_id = make_sweep(store, S.CANCELLED, [(P.CANCELLED, None), (P.QUEUED, None), (P.RUNNING, None)])
    assert not db.settle_point(store, sweep_id, 0, P.SUCCEEDED, run_id=3)
    assert not db.start_point(store, sweep_id, 1)  # the sweep was cancelled: the point ends so
    assert db.settle_point(store, sweep_id, 2, P.SUCCEEDED, run_id=4)
    assert [p.status for p in db.points(store, sweep_id)] == [P.CANCELLED, P.CANCELLED, P.SUCCEEDED]
