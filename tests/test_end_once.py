"""The end steps run exactly once for every run, whoever ends it (in process, on this machine, in seconds)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_notify import Receiver

from orchestrator import runflow
from orchestrator.config.hosts import local_host
from orchestrator.config.workspace import Workspace
from orchestrator.errors import OrchError
from orchestrator.runflow import notify, registry
from orchestrator.store import Store, lease
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from orchestrator.watch import follow
from playbooks.command import CommandSpec
from playbooks.extract_hidden_states import ExtractSpec

FAST = {"poll_min": 0.05, "poll_max": 0.2}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def start(ws: Workspace, store: Store, receiver: Receiver, cmd: str) -> runflow.Run:
    spec = CommandSpec(cmd=cmd, notify=[receiver.url], **FAST)
    return runflow.start(ws, store, registry.playbook("command"), spec, local_host(ws.root))


def assert_ended_once(run: runflow.Run, receiver: Receiver) -> None:
    for _ in range(2):  # whoever comes later finds nothing left to do
        runflow.finish(run)
        follow.watch(run)
    notify.drain(5)
    record = run.refresh()
    assert record.status.terminal
    assert record.end_steps == list(runflow.END_STEPS)
    finished = [e["message"] for e in run.store.events(run.run_id) if e["kind"] == "finished"]
    assert sorted(finished) == sorted(runflow.END_STEPS)
    assert [b["run_id"] for b in receiver.bodies] == [run.run_id]
    assert run.run_id not in [held.run_id for held in lease.held(run.store)]
    if record.launched:
        assert (run.ws.run_dir(run.run_id) / "log.tail").exists()


def ended_by_watch(run: runflow.Run) -> None:
    follow.watch(run)


def ended_by_poll(run: runflow.Run) -> None:
    deadline = time.monotonic() + 10
    while not runflow.poll(run).status.terminal and time.monotonic() < deadline:
        time.sleep(0.05)


def ended_by_cancel(run: runflow.Run) -> None:
    assert runflow.cancel(run, "cancelled by test", 1.0) in ("stopped", "killed")


def ended_by_stop(run: runflow.Run) -> None:
    assert runflow.stop(run, 1.0).startswith("process group stopped")


@pytest.mark.parametrize("end, cmd, status", [
    (ended_by_watch, "echo done", Status.SUCCEEDED),
    (ended_by_poll, "exit 3", Status.FAILED),
    (ended_by_cancel, "sleep 30", Status.CANCELLED),
    (ended_by_stop, "sleep 30", Status.CANCELLED),
])
def test_end_steps_once_whoever_ends_the_run(ws: Workspace, store: Store, receiver: Receiver,
                                             end: Callable[[runflow.Run], None], cmd: str, status: Status) -> None:
    run = start(ws, store, receiver, cmd)
    end(run)
    assert run.refresh().status is status
    assert_ended_once(run, receiver)


def test_end_steps_once_for_a_failed_start(ws: Workspace, store: Store, receiver: Receiver) -> None:
    spec = ExtractSpec(backend="speculators", model="m", dataset="d", scripts_dir=str(ws.root / "absent"),
                       notify=[receiver.url], **FAST)
    with pytest.raises(OrchError, match="not installed|not found"):
        runflow.start(ws, store, registry.playbook("extract-hidden-states"), spec, local_host(ws.root))
    (run,) = store.list_runs()
    assert run.status is Status.FAILED and run.reason.startswith("before launch:")
    assert_ended_once(runflow.open_run(ws, store, run), receiver)


def launching(ws: Workspace, store: Store, spec: CommandSpec) -> int:
    """A run whose controller died while launching it: its run dir named, no job pid written."""
    run_id = store.create_run("command", "local", spec.model_dump(mode="json"))
    store.update_run(run_id, remote_dir=str(ws.root / "runs" / str(run_id)))
    transition(store, run_id, Status.PREPARING)
    transition(store, run_id, Status.LAUNCHING)
    return run_id


def test_end_steps_once_for_an_orphan_settled(ws: Workspace, store: Store, receiver: Receiver) -> None:
    """A controller that died while launching: no pid file, so the run is lost, and finished once."""
    spec = CommandSpec(cmd="true", notify=[receiver.url], **FAST)
    run_id = launching(ws, store, spec)
    run = runflow.open_run(ws, store, run_id)
    assert runflow.settle_orphan(run).status is Status.LOST
    assert_ended_once(run, receiver)



def test_an_orphan_ended_meanwhile_by_another_process_is_left_as_it_found_it(
        ws: Workspace, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes settle a run whose controller died while launching: both find no job; the second finds
    the run ended lost already, and takes it as it is (no error, one end)."""
    from orchestrator.host import hostlease

    spec = CommandSpec(cmd="true", **FAST)
    run_id = launching(ws, store, spec)
    run = runflow.open_run(ws, store, run_id)
    monkeypatch.setattr(hostlease, "owner", lambda *a: "mine")

    def none_while_another_ends_it(paths: object) -> None:
        transition(store, run_id, Status.LOST, "ended by the other")

    monkeypatch.setattr(run.executor, "find", none_while_another_ends_it)
    record = runflow.settle_orphan(run)
    assert record.status is Status.LOST and record.reason == "ended by the other"
    assert [e["message"].split(":")[0] for e in store.events(run_id) if e["kind"] == "status"].count("lost") == 1


def test_an_orphan_picked_up_meanwhile_by_another_process_is_left_as_it_found_it(
        ws: Workspace, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes settle a run whose controller died while launching (its host's watcher, a resumed
    sweep): both find its job; the second finds it picked up already, and takes it as it is."""
    from orchestrator.host import hostlease
    from orchestrator.store.record import JobRef

    spec = CommandSpec(cmd="true", **FAST)
    run_id = launching(ws, store, spec)
    run = runflow.open_run(ws, store, run_id)
    job = JobRef(4242, "proof")
    monkeypatch.setattr(hostlease, "owner", lambda *a: "mine")

    def found_while_another_picks_it_up(paths: object) -> JobRef:
        transition(store, run_id, Status.RUNNING, "picked up by the other", **job.columns())
        return job

    monkeypatch.setattr(run.executor, "find", found_while_another_picks_it_up)
    record = runflow.settle_orphan(run)
    assert record.status is Status.RUNNING and record.job == job
    assert [e["message"] for e in store.events(run_id)].count("running: picked up by the other") == 1

def test_a_failing_end_step_does_not_skip_the_others(ws: Workspace, store: Store, receiver: Receiver,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    run = start(ws, store, receiver, "true")

    def broken(job: object, record: object) -> object:
        raise ValueError("a manifest that is not JSON")

    monkeypatch.setattr(run.pb, "finish", broken)
    follow.watch(run)
    notify.drain(5)
    warnings = [e["message"] for e in store.events(run.run_id) if e["kind"] == "warning"]
    assert warnings == ["outputs: ValueError: a manifest that is not JSON"]
    assert run.refresh().end_steps == list(runflow.END_STEPS) and len(receiver.bodies) == 1


def test_a_queued_run_starts_before_a_slow_notify_of_the_previous_run_ends(
        ws: Workspace, store: Store, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease is freed once the log is read to its end and the patches are reverted; the outputs, the
    log tail and the notification follow while the host's next run starts."""
    from orchestrator.runflow import ending, watching

    monkeypatch.setattr(watching, "spawn_host", lambda *a, **k: None)  # this test alone ends run 1
    notifying, gate, notified = threading.Event(), threading.Event(), threading.Event()
    real_notify = ending._notify

    def slow_notify(run: runflow.Run) -> None:
        notifying.set()
        gate.wait(120)  # a receiver that takes its time: until run 2 started, or two minutes
        real_notify(run)
        notified.set()

    monkeypatch.setattr(ending, "_notify", slow_notify)
    first = start(ws, store, receiver, "sleep 30")

    ender = cancel_elsewhere(ws, first.run_id)
    try:
        assert notifying.wait(20), "run 1's notify step never began"
        spec = CommandSpec(cmd="true", **FAST)
        second = runflow.start(ws, store, registry.playbook("command"), spec, local_host(ws.root), queue=True)
        assert not notified.is_set(), "run 2 started only after run 1's notification was sent"
        assert second.refresh().status in (Status.RUNNING, Status.SUCCEEDED)
        done = first.refresh().end_steps
        assert done[:3] == ["stop", "log to end", "patch revert"] and "notify" in done  # claimed, under way
    finally:
        gate.set()
        ender.join(30)
    notify.drain(5)
    assert [b["run_id"] for b in receiver.bodies] == [first.run_id]
    assert first.refresh().end_steps == list(runflow.END_STEPS)


def cancel_elsewhere(ws: Workspace, run_id: int) -> threading.Thread:
    """`cancel` of the run by another thread with its own store, as another orch process would."""
    def cancel() -> None:
        own = Store(ws.db_path)
        try:
            runflow.cancel(runflow.open_run(ws, own, run_id), "cancelled by test", 1.0)
        finally:
            own.close()

    ender = threading.Thread(target=cancel)
    ender.start()
    return ender


def test_the_next_run_waits_for_the_patch_revert(ws: Workspace, store: Store, receiver: Receiver,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An ended run whose patches are being reverted still holds its host (a next run's patches need the
    install as it was): a next start waits for its end steps, without --queue, rather than refuse it."""
    from orchestrator.runflow import ending, watching
    from orchestrator.store import lease

    monkeypatch.setattr(watching, "spawn_host", lambda *a, **k: None)  # this test alone ends run 1
    reverting, gate, held = threading.Event(), threading.Event(), threading.Event()
    real_revert, real_wait = ending._revert_patches, lease.wait_for_end_steps

    def slow_revert(run: runflow.Run) -> None:
        reverting.set()
        gate.wait(20)
        real_revert(run)

    def seen_waiting() -> None:
        held.set()
        real_wait()

    monkeypatch.setattr(ending, "_revert_patches", slow_revert)
    monkeypatch.setattr(lease, "wait_for_end_steps", seen_waiting)
    first = start(ws, store, receiver, "sleep 30")

    ender = cancel_elsewhere(ws, first.run_id)
    spec = CommandSpec(cmd="true", **FAST)
    got: list[object] = []
    starter = threading.Thread(target=lambda: got.append(
        runflow.start(ws, store, registry.playbook("command"), spec, local_host(ws.root))))
    try:
        assert reverting.wait(20), "run 1's patch revert never began"
        assert first.refresh().status is Status.CANCELLED
        starter.start()
        assert held.wait(20), "the next start was not held by run 1's end steps"
        assert not got  # the revert is held back: the host is still run 1's
    finally:
        gate.set()
        ender.join(30)
    starter.join(60)
    [second] = got
    assert isinstance(second, runflow.Run) and second.run_id != first.run_id
    assert first.refresh().end_steps == list(runflow.END_STEPS)


def test_an_ended_runs_lease_left_by_a_dead_finisher_goes_once_its_host_shows_the_job_over(
        ws: Workspace, store: Store, receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The record says the run ended, but whoever ended it died before its end steps, and its job still runs
    on the host: the host is believed, not the record nor a heartbeat — the lease stays until the job is over."""
    from orchestrator.runflow import watching
    from orchestrator.store import lease

    monkeypatch.setattr(watching, "spawn_host", lambda *a, **k: None)  # nobody else watches run 1
    gate = tmp_path / "gate"
    first = start(ws, store, receiver, f"while [ ! -e {gate} ]; do sleep 0.05; done")
    transition(store, first.run_id, Status.CANCELLED, "cancelled by a process that then died")
    store.conn.execute("UPDATE leases SET pid = ?, pid_start = '1' WHERE run_id = ?", (2**22 + 1, first.run_id))
    spec = CommandSpec(cmd="true", **FAST)
    with pytest.raises(lease.Busy, match=f"run {first.run_id}") as busy:
        runflow.start(ws, store, registry.playbook("command"), spec, local_host(ws.root))
    assert [held.run_id for held in lease.held(store)] == [first.run_id] and first.refresh().end_steps == []
    said = runflow.busy_message(store, busy.value)
    assert "(command, cancelled for " in said and "whoever ended it is gone, and its host has not shown its job over" in said
    gate.touch()
    deadline = time.monotonic() + 20
    while True:
        try:
            second = runflow.start(ws, store, registry.playbook("command"), spec, local_host(ws.root))
            break
        except lease.Busy:  # the job's wrapper sees the gate within a tick
            assert time.monotonic() < deadline, "the lease stayed after the job ended"
            time.sleep(0.1)
    assert second.run_id != first.run_id
    assert first.refresh().end_steps == list(runflow.END_STEPS)  # the steps left were done, then the lease freed


def _claim_then_die(ws: Workspace, run_id: int, status: Status) -> None:
    """Another process ends the run and claims its end steps up to the log's last read, then is killed (SIGKILL)
    before doing them."""
    import os
    import signal
    import subprocess
    import sys

    code = ("import sys, time\n"
            "from orchestrator.store import Store\nfrom orchestrator.store.lifecycle import transition\n"
            "from orchestrator.store.record import Status\n"
            "s = Store(sys.argv[1]); run_id = int(sys.argv[2])\n"
            "transition(s, run_id, Status(sys.argv[3]), 'ended by a watcher that then died')\n"
            "assert all(s.claim_end_step(run_id, name) == 'claimed' for name in ('stop', 'log to end'))\n"
            "print('claimed', flush=True); time.sleep(300)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(ws.db_path), str(run_id), status.value],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def _job_over(run: runflow.Run) -> None:
    deadline = time.monotonic() + 20
    while not (Path(run.paths.root) / ".orch" / "exit_code").exists():
        assert time.monotonic() < deadline, "the job never ended"
        time.sleep(0.05)


def test_an_end_step_whose_claimer_died_is_taken_over_by_the_next_finisher(
        ws: Workspace, store: Store, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.runflow import watching

    monkeypatch.setattr(watching, "spawn_host", lambda *a, **k: None)  # nobody else watches the run
    run = start(ws, store, receiver, "echo the last line")
    _job_over(run)
    _claim_then_die(ws, run.run_id, Status.SUCCEEDED)
    assert run.refresh().end_steps == ["stop", "log to end"] and run.run_id in [h.run_id for h in lease.held(store)]
    from orchestrator.runflow import ending

    def no_wait(seconds: float) -> None:
        raise AssertionError("waited for a step under way elsewhere, whose claimer is dead")

    real_wait = ending._await_steps_elsewhere
    monkeypatch.setattr(ending, "_await_steps_elsewhere", lambda store, runs, sleep=None: real_wait(store, runs, no_wait))
    runflow.finish(run)  # the dead claimer's step is taken over at once, never waited for
    assert "log to end: taken over (whoever had claimed it died before it was done)" in [
        e["message"] for e in store.events(run.run_id) if e["kind"] == "end step"]
    assert run.refresh().end_claims == {} and run.record.last_line == "the last line"
    assert_ended_once(run, receiver)


def test_a_failed_runs_job_left_running_by_a_finisher_that_died_is_stopped_by_the_next(
        ws: Workspace, store: Store, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run judged failed while its job ran (a fatal line: the job lingers), whose finisher died before the
    stop: the next finisher takes the stop over, then the rest of the end; its lease is freed."""
    from orchestrator.runflow import watching

    monkeypatch.setattr(watching, "spawn_host", lambda *a, **k: None)  # nobody else watches the run
    run = start(ws, store, receiver, "echo the last line; sleep 300")
    _claim_then_die(ws, run.run_id, Status.FAILED)
    job = run.refresh().job
    assert job is not None and run.executor.poll(run.paths, job, 0, 0).alive
    runflow.finish(run)
    assert not run.executor.poll(run.paths, job, 0, 0).alive
    assert [e["message"] for e in store.events(run.run_id) if e["kind"] == "stopped"] == ["process group: stopped"]
    assert "stop: taken over (whoever had claimed it died before it was done)" in [
        e["message"] for e in store.events(run.run_id) if e["kind"] == "end step"]
    assert run.refresh().status is Status.FAILED and run.record.exit_code is None
    assert_ended_once(run, receiver)


def test_the_lease_probe_stops_a_failed_runs_job_left_running_then_frees_the_host(
        ws: Workspace, store: Store, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run found by the lease's probe (the next start on its host): its job still runs, but its end
    steps would stop it, so it is finished rather than left holding the host."""
    from orchestrator.runflow import look, watching

    monkeypatch.setattr(watching, "spawn_host", lambda *a, **k: None)
    run = start(ws, store, receiver, "sleep 300")
    _claim_then_die(ws, run.run_id, Status.FAILED)
    look.probe_orphan(ws, store, run.refresh())
    job = run.refresh().job
    assert job is not None and not run.executor.poll(run.paths, job, 0, 0).alive
    assert run.run_id not in [h.run_id for h in lease.held(store)]
    assert_ended_once(run, receiver)


def test_an_ended_run_left_half_finished_is_finished_by_its_hosts_watcher_at_the_next_command(
        ws: Workspace, store: Store, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nobody starts a run on the host: the next orch command's look (ensure_watched) starts its host's
    watcher, which takes the dead claimer's step over and does the rest (outputs, log tail, notification)."""
    from orchestrator.runflow import watching

    real_spawn = watching.spawn_host
    monkeypatch.setattr(watching, "spawn_host", lambda *a, **k: None)
    run = start(ws, store, receiver, "echo the last line")
    _job_over(run)
    _claim_then_die(ws, run.run_id, Status.SUCCEEDED)
    assert store.abandoned_ends() and run.run_id in [h.run_id for h in lease.held(store)]
    monkeypatch.setattr(watching, "spawn_host", real_spawn)
    watching.ensure_watched(ws, store)
    deadline = time.monotonic() + 60
    while run.refresh().end_claims or run.record.end_steps != list(runflow.END_STEPS) or not receiver.bodies:
        assert time.monotonic() < deadline, f"never finished: {run.record.end_steps} {run.record.end_claims}"
        time.sleep(0.1)
    assert run.run_id not in [h.run_id for h in lease.held(store)] and not store.abandoned_ends()
    assert [b["run_id"] for b in receiver.bodies] == [run.run_id] and run.record.last_line == "the last line"


def test_a_cancelling_runs_job_seen_gone_ends_the_run_as_decided_not_failed_or_lost(
        ws: Workspace, store: Store, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run left cancelling (its host did not answer the stop) whose job is then seen gone — stopped by
    someone, or killed with the host — ends as its cancel decided, with its reason: no false `failed`."""
    import os
    import signal

    from orchestrator.runflow import watching

    monkeypatch.setattr(watching, "spawn_host", lambda *a, **k: None)
    run = start(ws, store, receiver, "sleep 30")
    transition(store, run.run_id, Status.CANCELLING, "cancelled by user", reason="cancelled by user",
               ending_as=Status.CANCELLED.value)
    job = run.refresh().job
    assert job is not None
    os.killpg(job.id, signal.SIGKILL)  # (the test's own job: its process group)
    deadline = time.monotonic() + 20
    while not runflow.poll(run).status.terminal:
        assert time.monotonic() < deadline, "the job's end was never seen"
        time.sleep(0.05)
    record = run.refresh()
    assert (record.status, record.reason) == (Status.CANCELLED, "cancelled by user")
    assert_ended_once(run, receiver)


def test_two_processes_completing_one_cancel_stop_its_job_once(
        ws: Workspace, store: Store, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The canceller and the host's watcher (which reconnected meanwhile) complete one run's cancel at once:
    one signals the job and records the stop, the other waits for it and finds the run ended."""
    from orchestrator.runflow import ending, watching

    monkeypatch.setattr(watching, "spawn_host", lambda *a, **k: None)
    run = start(ws, store, receiver, "echo up; trap 'sleep 3; exit 0' TERM; sleep 300 & wait")
    transition(store, run.run_id, Status.CANCELLING, "cancelled by user", reason="cancelled by user",
               ending_as=Status.CANCELLED.value)
    outcomes: list[str] = []
    both = threading.Barrier(2)

    def complete() -> None:
        mine = Store(ws.db_path)
        try:
            both.wait()
            outcomes.append(ending.complete_cancel(runflow.open_run(ws, mine, run.run_id), 20.0, look_first=False))
        finally:
            mine.close()

    threads = [threading.Thread(target=complete) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(outcomes) == ["stopped", "stopped by another orch process"], outcomes
    assert [e["message"] for e in store.events(run.run_id) if e["kind"] == "stopped"] == ["process group: stopped"]
    assert run.refresh().status is Status.CANCELLED
    assert_ended_once(run, receiver)
