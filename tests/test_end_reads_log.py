"""Whoever ends a run, its log is read to the last byte first: the recorded metrics end where the log ends.

A real sshd host and the SGLang emulator serving and printing decode stats; the run is watched until
ready and then left unpolled, as a detached server between two polls, so every decode line after that
is one the end itself must read.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sshd import SSHFleet, free_port
from test_gpu import FakeGpus, fake_gpus
from test_serve import EMULATOR, no_server_left_behind

from orchestrator import runflow
from orchestrator.config.hosts import Inventory, local_host
from orchestrator.config.workspace import Workspace
from orchestrator.runflow import registry
from orchestrator.store import Store
from orchestrator.store.record import Status
from orchestrator.sweep import control
from orchestrator.sweep import db as sweep_db
from orchestrator.sweep.plan import plan
from orchestrator.watch import follow

__all__ = ["fake_gpus", "no_server_left_behind"]  # fixtures

DECODE = re.compile(r"gen throughput \(token/s\): ([0-9.]+),")


def server_spec(**fields: Any) -> Any:
    """A serve-eagle3 spec whose launcher is the emulator: quick to load, then decode stats until stopped."""
    extra = ["--shards", "2", "--shard-time", "0.01", "--capture-time", "0.01",
             "--decode-stats", "100000", "--decode-interval", "0.03"]
    values = {"model": "/models/target", "draft_model": "/models/draft", "port": free_port("127.0.0.1"),
              "launcher": str(EMULATOR), "extra_args": extra, "poll_min": 0.05, "poll_max": 0.2, **fields}
    return registry.playbook("serve-eagle3").Spec(**values)


@pytest.fixture
def ssh_ws(tmp_path: Path, ssh_fleet: SSHFleet) -> Iterator[tuple[Workspace, Store, Inventory]]:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    ws.hosts_file.write_text(ssh_fleet.hosts_toml(test1={"workdir": str(tmp_path / "remote")}))
    store = Store(ws.db_path)
    yield ws, store, Inventory.load(ws.hosts_file, ws.root)
    store.close()


def serve_until_decoding(ws: Workspace, store: Store, host: Any, lines: int = 5, spec: Any = None,
                         **run_fields: Any) -> runflow.Run:
    """Start a server, watch it until ready, then let it print `lines` decode lines nobody polls."""
    run = runflow.start(ws, store, registry.playbook("serve-eagle3"), spec or server_spec(), host,
                        run_fields=run_fields)
    assert follow.watch(run, until_ready=True).phase in ("ready", "running")  # serving
    deadline = time.monotonic() + 30
    while len(decode_lines(run)) < lines:
        assert time.monotonic() < deadline, "the emulator printed no decode stats"
        time.sleep(0.05)
    return run


def decode_lines(run: runflow.Run) -> list[float]:
    """The decode stats the log holds (the host is this machine: its file is read directly)."""
    return [float(v) for v in DECODE.findall(Path(run.paths.log).read_text(errors="replace"))]


def assert_recorded_to_the_end(run: runflow.Run) -> None:
    record = run.refresh()
    assert record.status.terminal and "log to end" in record.end_steps
    printed = decode_lines(run)
    recorded = [v for _, v, _ in run.store.metric_series(run.run_id, "gen_throughput")]
    assert len(printed) >= 5
    assert recorded == printed  # every decode line, the last one included, and nothing twice
    assert run.store.latest_metrics(run.run_id)["gen_throughput"] == printed[-1]
    assert record.last_line and record.last_line in Path(run.paths.log).read_text(errors="replace").splitlines()[-1]


def ended_by_stop(ws: Workspace, store: Store, inv: Inventory, run: runflow.Run) -> None:
    runflow.stop(run, grace_s=3)


def ended_by_cancel(ws: Workspace, store: Store, inv: Inventory, run: runflow.Run) -> None:
    runflow.cancel(run, "cancelled by test", grace_s=3)


def ended_by_replace(ws: Workspace, store: Store, inv: Inventory, run: runflow.Run) -> None:
    new = runflow.start(ws, store, registry.playbook("command"), registry.playbook("command").Spec(cmd="true"),
                        inv.get("test1"), replace=True)
    assert run.refresh().reason == f"replaced by run {new.run_id}"
    follow.watch(new)


@pytest.mark.parametrize("end, status", [
    (ended_by_stop, Status.CANCELLED), (ended_by_cancel, Status.CANCELLED), (ended_by_replace, Status.CANCELLED),
], ids=["stop", "cancel", "replace"])
def test_a_run_ended_by_another_records_its_log_to_the_last_line(
        ssh_ws: tuple[Workspace, Store, Inventory],
        end: Callable[[Workspace, Store, Inventory, runflow.Run], None], status: Status) -> None:
    ws, store, inv = ssh_ws
    run = serve_until_decoding(ws, store, inv.get("test1"))
    end(ws, store, inv, run)
    assert run.refresh().status is status
    assert_recorded_to_the_end(run)


def test_a_run_whose_end_is_read_elsewhere_while_it_is_stopped_records_its_log_to_the_last_line(
        ssh_ws: tuple[Workspace, Store, Inventory]) -> None:
    """A cancel records its decision (`cancelling`) before it signals the job, the job still printing. Here
    the signal waits until the job printed on: those lines are recorded too."""
    ws, store, inv = ssh_ws
    run = serve_until_decoding(ws, store, inv.get("test1"))
    kill = run.executor.kill

    def kill_once_it_printed_on(job: Any, grace_s: float) -> str:
        assert run.store.get_run(run.run_id).status is Status.CANCELLING  # decided, not ended: no end step yet
        printed = len(decode_lines(run))
        wait_until(lambda: len(decode_lines(run)) >= printed + 3)
        return kill(job, grace_s)

    run.executor.kill = kill_once_it_printed_on  # type: ignore[method-assign]
    runflow.cancel(run, "cancelled by test", grace_s=3)
    assert_recorded_to_the_end(run)


def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_run_that_ends_by_itself_records_its_log_to_the_last_line(
        ssh_ws: tuple[Workspace, Store, Inventory]) -> None:
    ws, store, inv = ssh_ws
    spec = server_spec(extra_args=["--shards", "2", "--shard-time", "0.01", "--capture-time", "0.01",
                                   "--decode-stats", "12", "--decode-interval", "0.01"])
    run = runflow.start(ws, store, registry.playbook("serve-eagle3"), spec, inv.get("test1"))
    assert follow.watch(run).status is Status.SUCCEEDED
    assert_recorded_to_the_end(run)


def test_a_sweep_cancelled_records_its_running_points_log_to_the_last_line(
        ssh_ws: tuple[Workspace, Store, Inventory], tmp_path: Path) -> None:
    ws, store, inv = ssh_ws
    sweep_file = tmp_path / "serve.toml"
    sweep_file.write_text(f'name = "serve"\nplaybook = "serve-eagle3"\nhosts = ["test1"]\n'
                          f'[spec]\nmodel = "/models/target"\ndraft_model = "/models/draft"\n'
                          f'launcher = {json.dumps(str(EMULATOR))}\n[matrix]\nport = [{free_port("127.0.0.1")}]\n')
    sweep_id = sweep_db.register(store, plan(ws, store, sweep_file))
    run = serve_until_decoding(ws, store, inv.get("test1"), sweep_id=sweep_id, point="port=1")
    sweep_db.attach_run(store, sweep_id, 0, run.run_id)
    done = control.cancel(ws, str(sweep_id), grace_s=3)
    assert list(done["stopped"]) == [run.run_id]
    assert run.refresh().reason == "sweep cancelled"
    assert_recorded_to_the_end(run)


def test_a_run_stopped_by_another_runs_gpu_cleanup_records_its_log_to_the_last_line(
        fake_gpus: FakeGpus, ws: Workspace, store: Store) -> None:
    """On this machine, the tests-only nvidia-smi showing the server (leased GPU 1) on GPU 0 too, which the
    next run asks for."""
    run = serve_until_decoding(ws, store, local_host(ws.root), spec=server_spec(gpus=[1]))
    fake_gpus.add(int(run.record.pid or 0), 0)
    command = registry.playbook("command")
    nxt = runflow.start(ws, store, command, command.Spec(cmd="true", gpus=[0], poll_min=0.05, poll_max=0.2),
                        local_host(ws.root))
    record = run.refresh()  # stopped by the next run's GPU cleanup, elsewhere
    assert record.status is Status.CANCELLED and str(nxt.run_id) in (record.reason or "")
    follow.watch(nxt)
    assert_recorded_to_the_end(run)
