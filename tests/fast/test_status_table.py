"""The runs table a person reads, in process: status words, reason, duration, URL, --active, colour,
and `compare --previous`; runs are written to the store as the run flow leaves them."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from rich.console import Console

from orchestrator.cli import render, status
from orchestrator.store import Store
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status

Orch = Callable[..., tuple[int, str, str]]
HOSTS = '[hosts.gpu01]\naddress = "10.1.2.3"\n'


@pytest.fixture
def orch(records_orch: Orch) -> Orch:
    return records_orch


@pytest.fixture
def store(records_store: Store) -> Store:
    return records_store


def make_run(store: Store, playbook: str = "command", host: str = "local", spec: dict[str, Any] | None = None,
             end: Status | None = None, reason: str = "", took: float | None = None, **fields: Any) -> int:
    run_id = store.create_run(playbook, host, spec or {})
    for s in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, s)
    now = time.time()
    store.update_run(run_id, started_at=now - (took or 5), **fields)
    if end is not None:
        transition(store, run_id, end, reason, ended_at=now)
    return run_id


def rows(stdout: str) -> dict[str, dict[str, str]]:
    """The piped table as {id: {column: value}}."""
    header, *lines = [line.split("\t") for line in stdout.splitlines()]
    assert header == status.COLUMNS and all(len(line) == len(header) for line in lines)
    return {line[0]: dict(zip(header, line)) for line in lines}


def test_status_words_reason_and_duration(orch: Orch, store: Store) -> None:
    done = make_run(store, end=Status.SUCCEEDED, reason="exit code 0", took=125.0)  # a reason nobody needs
    stopped = make_run(store, "serve-eagle3", end=Status.CANCELLED, reason="stopped by user")
    replaced = make_run(store, "serve-eagle3", end=Status.CANCELLED, reason="replaced by run 9")
    cancelled = make_run(store, end=Status.CANCELLED, reason="cancelled by user")
    long_reason = "exit code 1:" + " a reason no column may cut" * 8
    failed = make_run(store, end=Status.FAILED, reason=long_reason)
    code, out, _ = orch("status")
    assert code == 0
    table = rows(out)
    assert {i: table[str(i)]["status"] for i in (done, stopped, replaced, cancelled, failed)} == {
        done: "succeeded", stopped: "stopped", replaced: "stopped", cancelled: "cancelled", failed: "failed"}
    assert table[str(done)]["duration"] == "2m05s" and table[str(done)]["reason"] == ""
    assert table[str(failed)]["reason"] == long_reason
    assert table[str(stopped)]["reason"] == "stopped by user"
    # the lifecycle's status is unchanged; the word shown is a field of its own
    doc = json.loads(orch("status", str(stopped), "--json")[1])
    assert (doc["status"], doc["shown_status"]) == ("cancelled", "stopped")


def test_a_host_not_answering_shows_unreachable_until_it_answers(orch: Orch, store: Store) -> None:
    run_id = make_run(store, heartbeat=time.time() - 120)
    store.add_event(run_id, "unreachable", "no answer from 10.1.2.3:22 within 10 s")
    assert rows(orch("status")[1])[str(run_id)]["status"] == "unreachable"
    assert rows(orch("status")[1])[str(run_id)]["seen"] == "2m ago"
    doc = json.loads(orch("status", str(run_id), "--json")[1])
    assert doc["status"] == "running" and doc["unreachable_since"] is not None
    assert "the host has not answered for" in orch("status", str(run_id))[1]
    store.add_event(run_id, "reconnected", "host answered again after 30 s")
    assert rows(orch("status")[1])[str(run_id)]["status"] == "running"
    assert json.loads(orch("status", str(run_id), "--json")[1])["unreachable_since"] is None


def test_a_plain_job_is_running_once_it_prints(orch: Orch, store: Store) -> None:
    silent = make_run(store, phase="starting", parser_state={"engine": None, "lines": 0})
    printing = make_run(store, phase="starting", parser_state={"engine": None, "lines": 1})
    generic = make_run(store, phase="starting", parser_state={"engine": "generic", "lines": 3})
    server = make_run(store, phase="starting", parser_state={"engine": "sglang", "lines": 3})
    table = rows(orch("status")[1])
    assert [table[str(i)]["phase"] for i in (silent, printing, generic, server)] == [
        "starting", "running", "running", "starting"]
    doc = json.loads(orch("status", str(printing), "--json")[1])
    assert (doc["phase"], doc["shown_phase"]) == ("starting", "running")


def test_a_ready_server_shows_where_it_answers(orch: Orch, store: Store) -> None:
    spec = {"model": "/m", "draft_model": "/d", "port": 31000}
    loopback = make_run(store, "serve-eagle3", "gpu01", spec, phase="ready")
    everywhere = make_run(store, "serve-eagle3", "gpu01", {**spec, "extra_args": ["--host", "0.0.0.0"]},
                          phase="running")
    loading = make_run(store, "serve-eagle3", "gpu01", spec, phase="loading")
    plain = make_run(store, phase="running")
    table = rows(orch("status")[1])
    assert table[str(loopback)]["url"] == "http://127.0.0.1:31000"
    assert table[str(everywhere)]["url"] == "http://10.1.2.3:31000"
    assert table[str(loading)]["url"] == table[str(plain)]["url"] == ""
    assert json.loads(orch("status", str(everywhere), "--json")[1])["url"] == "http://10.1.2.3:31000"


def test_active_lists_only_runs_not_ended(orch: Orch, store: Store) -> None:
    make_run(store, end=Status.SUCCEEDED)
    running = make_run(store)
    make_run(store, end=Status.FAILED, reason="exit code 2")
    assert list(rows(orch("status", "--active")[1])) == [str(running)]
    assert [d["id"] for d in json.loads(orch("status", "--active", "--json")[1])] == [running]
    assert json.loads(orch("status", "--active", "--status", "failed", "--json")[1]) == []


def test_on_a_terminal_statuses_are_coloured_and_empty_columns_left_out(
    orch: Orch, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_run(store, end=Status.SUCCEEDED)
    make_run(store, end=Status.FAILED, reason="exit code 2")
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, color_system="standard", width=200, highlight=False)
    monkeypatch.setattr(render, "out", console)
    monkeypatch.setattr(status, "out", console)
    orch("status")
    text = screen.getvalue()
    assert "\x1b[32msucceeded" in text and "\x1b[31mfailed" in text  # green, red
    header = text.splitlines()[0]
    assert "reason" in header and "url" not in header and "name" not in header


def test_compare_previous_is_the_run_before_on_the_same_host(orch: Orch, store: Store) -> None:
    first = make_run(store, "serve-eagle3", "gpu01", end=Status.CANCELLED, reason="stopped by user")
    make_run(store, "serve-eagle3", "local", end=Status.CANCELLED, reason="stopped by user")  # another host
    make_run(store, "command", "gpu01", end=Status.SUCCEEDED)  # another playbook
    second = make_run(store, "serve-eagle3", "gpu01", end=Status.CANCELLED, reason="stopped by user")
    store.add_metrics(first, [("gen_throughput", 88.8, None)], time.time())
    store.add_metrics(second, [("gen_throughput", 94.0, None)], time.time())
    found = json.loads(orch("compare", str(second), "--previous", "--json")[1])
    assert found["runs"] == [first, second]
    assert found["metrics"]["gen_throughput"]["values"] == [88.8, 94.0]
    assert found["metrics"]["gen_throughput"]["better"] == [None, True]
    newest = make_run(store, "serve-eagle3", "gpu01")
    assert json.loads(orch("compare", "--previous", "--json")[1])["runs"] == [second, newest]
    assert orch("compare", "--previous")[1].splitlines()[0].split("\t")[1:] == [
        f"run {second} (previous)", f"run {newest}"]
    code, _, err = orch("compare", str(first), "--previous")
    assert code == 2 and f"run {first} is the first run of serve-eagle3 on gpu01" in err
    assert orch("compare", str(first), str(second), "--previous")[0] == 2


def test_status_filters_by_sweep_and_age(orch: Orch, store: Store) -> None:
    for _ in range(3):
        make_run(store, end=Status.SUCCEEDED)
    with store.tx() as c:  # run 1 is three days old and run 2 belongs to a sweep
        c.execute("UPDATE runs SET created_at = created_at - 3 * 86400 WHERE id = 1")
        c.execute("UPDATE runs SET sweep_id = 5 WHERE id = 2")

    def ids(*args: str) -> list[int]:
        code, out, err = orch("status", *args, "--json")
        assert code == 0, err
        return [d["id"] for d in json.loads(out)]

    assert ids("--since", "2h") == [3, 2] and ids("--since", "4d") == [3, 2, 1]
    assert ids("--sweep", "5") == [2] and ids("--sweep", "5", "--since", "1h") == [2] and ids("--sweep", "6") == []
    code, _, err = orch("status", "--since", "1d", "-n", "1")
    assert code == 0 and "showing 1 of 2 runs" in err
    assert orch("status", "--since", "yesterday")[0] == 2
