"""Recording a turn of pushes in one transaction (in process): a watcher killed at any moment leaves the
record where the next one reads on from, with no line, event or metric sample lost or counted twice."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from recording import Clock, FakeExecutor, new_run

from orchestrator.config.workspace import Workspace
from orchestrator.errors import DatabaseUnavailable
from orchestrator.host.agent import Push
from orchestrator.host.launch import JobState
from orchestrator.host.ssh import SSHTransport
from orchestrator.runflow.recorder import Recorder, WatchOptions
from orchestrator.runflow.watching import WatchLock
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.watch.hostwatch import BEAT_WRITE_S, SYNC_S, HostWatcher

# a job's log: a loading bar, the ready line, metrics, a phase change, more metrics
LOG = b"".join([
    b"Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01]\n",
    b"Loading safetensors checkpoint shards: 100% Completed | 2/2 [00:02<00:00]\n",
    *(b"orch-metric loss=%d.5 tok_s=%d\n" % (10 - i, 90 + i) for i in range(6)),
    b"[2026-12-02 10:00:00 TP0] The server is fired up and ready to roll!\n",
    *(b"orch-metric accept=%d\n" % i for i in range(5)),
])
CHUNKS = [LOG[i:i + 61] for i in range(0, len(LOG), 61)]  # cut mid-line, as pushes come


def watcher(store: Store, run_id: int, clock: Clock) -> Recorder:
    return Recorder(store, run_id, FakeExecutor(), WatchOptions(poll_min=30, poll_max=600), clock=clock)  # type: ignore[arg-type]


def state(w: Recorder, data: bytes, last: bool = False) -> JobState:
    """The next push of the run's log, read on from the watcher's offset; the last one says the job ended."""
    return JobState(alive=not last, exit_code=0 if last else None, size=w.offset + len(data), offset=w.offset,
                    data=data, started_at=999_000.0, ended_at=999_100.0 if last else None)


def turn(store: Store, watchers: list[Recorder], data: list[bytes], last: bool,
         kill_at: str | None = None) -> None:
    """What a host's watcher does in one turn: stage each run's push, commit all in one transaction,
    settle each. `kill_at` stops there, as a SIGKILL would (nothing after it runs)."""
    for w, chunk in zip(watchers, data):
        w.stage(state(w, chunk, last))
    if kill_at == "staged":
        raise Killed()
    with store.tx():
        for i, w in enumerate(watchers):
            w.commit()
            if kill_at == "mid-transaction" and i == 0:
                raise Killed()  # the transaction is rolled back: as if the process died before COMMIT
    if kill_at == "committed":
        raise Killed()
    for w in watchers:
        w.settle()


class Killed(Exception):
    pass


def record_of(store: Store, run_id: int) -> dict[str, Any]:
    events = [(e["kind"], e["message"]) for e in store.events(run_id)]
    metrics = store.conn.execute("SELECT name, value, step FROM metrics WHERE run_id = ? ORDER BY id",
                                 (run_id,)).fetchall()
    run = store.get_run(run_id)
    return {"events": events, "metrics": metrics, "offset": run.log_offset, "status": run.status,
            "phase": run.phase, "progress": run.progress}


def follow(db: Path, tmp: Path, kill_turn: int | None, kill_at: str | None) -> list[dict[str, Any]]:
    """Two runs on one host, their logs pushed chunk by chunk and recorded a turn at a time; at turn
    `kill_turn` the watcher dies at `kill_at` and a new one (a new connection, watchers read back from the
    record) goes on from the offsets recorded, as the agent does once told them."""
    store = Store(db)
    ids = [new_run(store, tmp), new_run(store, tmp)]
    clock = Clock()
    watchers = [watcher(store, i, clock) for i in ids]
    n = 0
    while any(w.offset < len(LOG) for w in watchers) or not all(w.status.terminal for w in watchers):
        data = [LOG[w.offset:w.offset + 61] for w in watchers]
        last = all(w.offset + len(d) >= len(LOG) for w, d in zip(watchers, data))
        try:
            turn(store, watchers, data, last, kill_at if n == kill_turn else None)
        except Killed:
            store.conn.close()  # the process is gone: its connection, and all it held in memory
            store = Store(db)
            watchers = [watcher(store, i, clock) for i in ids]
        n += 1
        assert n < 100
    records = [record_of(store, i) for i in ids]
    store.close()
    return records


@pytest.mark.parametrize("kill_at", ["staged", "mid-transaction", "committed"])
@pytest.mark.parametrize("kill_turn", [0, 3, 7])
def test_a_watcher_killed_at_any_moment_loses_and_doubles_nothing(tmp_path: Path, kill_at: str,
                                                                   kill_turn: int) -> None:
    whole = follow(tmp_path / "whole.db", tmp_path, None, None)
    killed = follow(tmp_path / "killed.db", tmp_path, kill_turn, kill_at)
    assert killed == whole
    run = whole[0]
    assert run["status"] == Status.SUCCEEDED and run["offset"] == len(LOG)
    assert [m[0] for m in run["metrics"]].count("loss") == 6 and [m[0] for m in run["metrics"]].count("accept") == 5
    phases = [e for e in run["events"] if e[0] == "phase"]
    assert ("phase", "ready") in phases and len(phases) == len(set(phases))


def test_one_runs_conflict_rolls_back_only_its_part_of_the_transaction(store: Store, tmp_path: Path) -> None:
    clock = Clock()
    a, b = (watcher(store, new_run(store, tmp_path), clock) for _ in range(2))
    other = Store(store.path)  # another writer records a's bytes first
    for w in (a, b):
        w.stage(state(w, LOG[:200]))
    other.update_run(a.run_id, log_offset=200)
    with store.tx():
        a.commit()
        b.commit()
    assert not a.settle() and not a.recorded and a.offset == 200  # read back from the record
    assert b.settle() is False and b.recorded and b.offset == 200
    assert store.conn.execute("SELECT COUNT(*) FROM metrics WHERE run_id = ?", (a.run_id,)).fetchone()[0] == 0
    assert store.conn.execute("SELECT COUNT(*) FROM metrics WHERE run_id = ?", (b.run_id,)).fetchone()[0] > 0
    other.close()


def test_a_refused_transaction_leaves_every_run_where_its_record_is(store: Store, tmp_path: Path) -> None:
    clock = Clock()
    a, b = (watcher(store, new_run(store, tmp_path), clock) for _ in range(2))
    for w in (a, b):
        w.stage(state(w, LOG[:200]))
    for w in (a, b):
        w.refused(DatabaseUnavailable("locked"))
        assert not w.settle() and not w.recorded and w.offset == 0
    for w in (a, b):  # the next push reads the record back first, then goes on
        w.stage(state(w, LOG[:200]))
    with store.tx():
        a.commit()
        b.commit()
    for w in (a, b):
        assert w.settle() is False and w.recorded and w.offset == store.get_run(w.run_id).log_offset == 200
        assert [e["kind"] for e in store.events(w.run_id)].count("database") == 1


def test_changed_sees_other_connections_writes_not_its_own(store: Store, tmp_path: Path) -> None:
    assert store.changed()  # the first look
    new_run(store, tmp_path)
    assert not store.changed()
    other = Store(store.path)
    new_run(other, tmp_path)
    assert store.changed() and not store.changed()
    other.close()


def test_a_savepoint_rolls_back_its_part_alone(store: Store, tmp_path: Path) -> None:
    run_id = new_run(store, tmp_path)
    with store.tx():
        store.add_event(run_id, "kept")
        with pytest.raises(ValueError), store.savepoint():
            store.add_event(run_id, "dropped")
            raise ValueError()
    kinds = [e["kind"] for e in store.events(run_id)]
    assert "kept" in kinds and "dropped" not in kinds


def push(run_id: int, offset: int, data: bytes) -> Push:
    doc = {"push": "state", "key": str(run_id), "alive": True, "wrapper": True, "exit_code": None,
           "size": offset + len(data), "offset": offset, "data": data,
           "run_dir": True, "inode": None, "node": None, "rotated": False, "started_at": 999_000.0, "ended_at": None}
    return Push("state", str(run_id), doc)


def test_a_turn_of_pushes_is_one_transaction_with_one_push_per_run(ws: Workspace, store: Store,
                                                                   tmp_path: Path) -> None:
    ws.runs_dir.mkdir(parents=True, exist_ok=True)
    hw = HostWatcher(ws, "local", echo=lambda text: None)
    ids = [new_run(store, tmp_path), new_run(store, tmp_path)]
    for run_id in ids:
        hw._adopt(store.get_run(run_id))
    commits: list[str] = []
    trace: Callable[[str], None] = lambda sql: commits.append(sql) if sql == "COMMIT" else None
    hw.store.conn.set_trace_callback(trace)
    a, b = ids
    hw._take_turn([push(a, 0, LOG[:100]), push(a, 100, LOG[100:200]), push(b, 0, LOG[:150])])
    assert len(commits) == 1  # both runs' records in one transaction
    assert store.get_run(a).log_offset == 100 and store.get_run(b).log_offset == 150
    assert [p.doc["offset"] for p in hw._later] == [100]  # a's second push: next turn, after its first
    hw._take_turn([])
    assert store.get_run(a).log_offset == 200 and len(commits) == 2
    hw.store.conn.set_trace_callback(None)
    for f in hw.runs.values():
        f.lock.release()
    hw.store.close()


def test_the_agents_beat_refreshes_the_heartbeat_of_the_runs_followed_now_and_then(ws: Workspace, store: Store,
                                                                                   tmp_path: Path) -> None:
    """`seen` is how long ago the host was heard from, not how far the poll backoff has grown: the agent's
    beat (every 2 s) sets the heartbeat of the runs this watcher follows and records, in one transaction,
    at most every BEAT_WRITE_S."""
    ws.runs_dir.mkdir(parents=True, exist_ok=True)
    hw = HostWatcher(ws, "local", echo=lambda text: None)
    clock = [1000.0]
    hw.clock = lambda: clock[0]
    mine, also_mine, elsewhere, ended, unfollowed = (new_run(store, tmp_path) for _ in range(5))
    followed = [mine, also_mine, elsewhere, ended]
    for run_id in followed:
        hw._adopt(store.get_run(run_id))
    hw._take_turn([push(run_id, 0, LOG[:100]) for run_id in followed])  # each recorded once: watched here
    store.update_run(elsewhere, watcher="otherhost:77:1")  # the record names another watcher
    transition(store, ended, Status.CANCELLED, "cancelled")
    long_ago = time.time() - 300  # the last poll, on a long backoff

    def beat() -> dict[int, bool]:
        """One beat of the agent: which runs it refreshed (`commits`: what it wrote)."""
        for run_id in (*followed, unfollowed):
            store.update_run(run_id, heartbeat=long_ago)
        commits.clear()
        hw._take_turn([Push("beat", doc={"push": "beat", "time": time.time()})])
        return {run_id: store.get_run(run_id).heartbeat != long_ago for run_id in (*followed, unfollowed)}

    commits: list[str] = []
    trace: Callable[[str], None] = lambda sql: commits.append(sql.split()[0]) if sql.startswith(
        ("UPDATE", "COMMIT")) else None
    hw.store.conn.set_trace_callback(trace)
    before = time.time()
    assert beat() == {mine: True, also_mine: True, elsewhere: False, ended: False, unfollowed: False}
    assert commits == ["UPDATE", "COMMIT"]  # one write for all the host's runs
    assert store.get_run(mine).heartbeat >= before  # type: ignore[operator]
    clock[0] += 2.0
    assert not any(beat().values()) and not commits  # the next beat, 2 s on: nothing written
    clock[0] += BEAT_WRITE_S - 2.0
    assert beat()[mine] and commits == ["UPDATE", "COMMIT"]
    hw.store.conn.set_trace_callback(None)
    for f in hw.runs.values():
        f.lock.release()
    hw.store.close()


def test_a_watcher_whose_host_does_not_answer_waits_for_its_next_retry(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With the host unreachable and its runs due for a look, the loop sleeps until the next connection
    attempt or look at the record, instead of turning round at once."""
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    ws.hosts_file.write_text('[hosts.gone]\naddress = "127.0.0.1"\nport = 1\nconnect_timeout = 2\n')
    store = Store(ws.db_path)
    run_id = store.create_run("command", "gone", {"cmd": "true"})
    for status in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, status)
    store.update_run(run_id, remote_dir=str(tmp_path / "r"))
    transition(store, run_id, Status.RUNNING, pid=4242, pid_start="1")
    hw = HostWatcher(ws, "gone", echo=lambda text: None)
    sleeps: list[float] = []
    clock = [1000.0]  # the loop's time passes only while it sleeps: a slow machine changes nothing

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock[0] += seconds
        if len(sleeps) >= 8:
            hw.stopping.set()

    hw.clock, hw.sleep = (lambda: clock[0]), sleep
    monkeypatch.setattr(SSHTransport, "retry_sleep", staticmethod(lambda seconds: None))  # (quick refusals)
    assert hw.serve()
    assert len(sleeps) == 8 and all(s > 0.5 for s in sleeps), sleeps
    assert clock[0] - 1000.0 >= 8, sleeps
    store.close()


def test_a_run_its_starter_hands_over_late_is_taken_at_the_next_look(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher's look at the record falls between the launch and the starter letting go of the run's
    lock: nothing writes the record at the hand-over, yet the run is taken at the next look, and the
    watcher, left with no run it follows meanwhile, does not linger out."""
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    ws.hosts_file.write_text('[hosts.gone]\naddress = "127.0.0.1"\nport = 1\nconnect_timeout = 2\n')
    store = Store(ws.db_path)
    run_id = store.create_run("command", "gone", {"cmd": "true"})
    for status in (Status.PREPARING, Status.LAUNCHING):
        transition(store, run_id, status)
    store.update_run(run_id, remote_dir=str(tmp_path / "r"))
    transition(store, run_id, Status.RUNNING, pid=4242, pid_start="1")
    starters_lock = WatchLock(ws, run_id)
    assert starters_lock.acquire()  # launched, recorded, not yet let go
    hw = HostWatcher(ws, "gone", echo=lambda text: None)
    clock = [1000.0]  # the loop's time passes only while it sleeps

    def sleep(seconds: float) -> None:
        starters_lock.release()  # the hand-over, right after the watcher's first look
        clock[0] += seconds
        if run_id in hw.runs or clock[0] - 1000.0 > 60:
            hw.stopping.set()

    hw.clock, hw.sleep = (lambda: clock[0]), sleep
    monkeypatch.setattr(SSHTransport, "retry_sleep", staticmethod(lambda seconds: None))  # (quick refusals)
    assert hw.serve()
    assert run_id in hw.runs
    assert clock[0] - 1000.0 <= SYNC_S + 1  # at the next look at the record, not the next full read
    store.close()
