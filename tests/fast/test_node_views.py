"""How a multi-node run shows, in process: `orch status` (its nodes, the slowest node's progress, a node's
own record), `orch logs` (every node's lines headed by rank and host, one node's with --node), `orch pull`
(a folder per node), and `rm`/`cancel` refusing a node alone. The node records are written to the store as
the run flow leaves them: the head is the run (rank 0), each other node names it as its parent."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator import runflow
from orchestrator.cli import logs
from orchestrator.store import Store, runtable
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status

Orch = Callable[..., tuple[int, str, str]]
HOSTS = '[hosts.gpu01]\naddress = "10.1.2.3"\n[hosts.gpu02]\naddress = "10.1.2.4"\n'


@pytest.fixture
def orch(records_orch: Orch) -> Orch:
    return records_orch


@pytest.fixture
def store(records_store: Store) -> Store:
    return records_store


def make_run(store: Store, host: str, end: Status | None = None, **fields: Any) -> int:
    run_id = store.create_run("command", host, {})
    for s in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        transition(store, run_id, s)
    store.update_run(run_id, started_at=time.time() - 5, **fields)
    if end is not None:
        transition(store, run_id, end, "exit code 0", ended_at=time.time())
    return run_id


def multi_node(store: Store, hosts: list[str], end: Status | None = None, **per_rank: dict[str, Any]) -> list[int]:
    """A run of one record per host: the head (rank 0) first; `r1={...}` fields of rank 1's record."""
    head = make_run(store, hosts[0], end, node_rank=0, **per_rank.get("r0", {}))
    others = [make_run(store, h, end, parent_id=head, node_rank=rank, **per_rank.get(f"r{rank}", {}))
              for rank, h in enumerate(hosts[1:], start=1)]
    return [head, *others]


def bar(done: int, total: int) -> dict[str, Any]:
    return {"label": "steps", "done": done, "total": total}


def test_status_json_lists_the_nodes_and_the_slowest_progress(orch: Orch, store: Store) -> None:
    head, second, third = multi_node(store, ["gpu01", "gpu02", "gpu02"],
                                     r0={"progress": bar(80, 100), "pid": 101, "remote_dir": "/w/runs/1"},
                                     r1={"progress": bar(30, 100), "job_id": 4242},
                                     r2={"progress": None})
    single = make_run(store, "gpu01", progress=bar(5, 10))
    code, out, _ = orch("status", str(head), "--json")
    assert code == 0
    doc = json.loads(out)
    # the run is done only when its slowest rank is: rank 1's bar; a node printing none is left out
    assert (doc["progress"]["done"], doc["progress"]["total"]) == (30, 100)
    assert doc["hosts"] == ["gpu01", "gpu02", "gpu02"] and doc["parent_id"] is None
    assert [(n["rank"], n["id"], n["host"], n["job"]) for n in doc["nodes"]] == [
        (0, head, "gpu01", 101), (1, second, "gpu02", 4242), (2, third, "gpu02", None)]
    assert set(doc["nodes"][0]) == {"rank", "id", "host", "status", "phase", "job", "log_offset", "progress",
                                    "reason", "remote_dir"}
    assert doc["nodes"][0]["remote_dir"] == "/w/runs/1" and doc["nodes"][1]["progress"]["percent"] == 30
    one = json.loads(orch("status", str(single), "--json")[1])
    assert one["nodes"] == [] and one["progress"]["done"] == 5 and one["hosts"] == ["gpu01"]


def test_a_node_of_its_own_names_its_run(orch: Orch, store: Store) -> None:
    head, second = multi_node(store, ["gpu01", "gpu02"])
    doc = json.loads(orch("status", str(second), "--json")[1])
    assert (doc["id"], doc["parent_id"], doc["node_rank"], doc["nodes"]) == (second, head, 1, [])
    code, out, _ = orch("status", str(second))
    assert code == 0 and f"node 1 of run {head}" in out


def test_status_text_shows_the_node_table(orch: Orch, store: Store) -> None:
    head, second = multi_node(store, ["gpu01", "gpu02"], r1={"progress": bar(3, 9), "pid": 77})
    code, out, _ = orch("status", str(head))
    assert code == 0
    assert f"run {head} command on gpu01,gpu02" in out and "(the slowest node's)" in out
    rows = [line.split("\t") for line in out.splitlines() if "\t" in line]
    assert rows[0][:3] == ["rank", "id", "host"]
    assert [r[:3] for r in rows[1:3]] == [["0", str(head), "gpu01"], ["1", str(second), "gpu02"]]


def test_the_runs_table_lists_runs_not_nodes(orch: Orch, store: Store) -> None:
    head = multi_node(store, ["gpu01", "gpu02"])[0]
    wide = multi_node(store, ["gpu01", "gpu02", "a-long-host-name", "another-long-one"])[0]
    code, out, _ = orch("status")
    assert code == 0
    table = {line.split("\t")[0]: line.split("\t") for line in out.splitlines()[1:]}
    assert set(table) == {str(head), str(wide)}  # no row of a node of its own
    host = out.splitlines()[0].split("\t").index("host")
    assert table[str(head)][host] == "gpu01,gpu02" and table[str(wide)][host] == "gpu01+3"
    # the dashboard's table and its count, too
    found = runtable.rows(store, runtable.RunFilters(), 50)
    assert [r["id"] for r in found] == [wide, head]
    assert runtable.count(store, runtable.RunFilters(), 100) == 2
    # a run is on each of its nodes' hosts
    assert runtable.count(store, runtable.RunFilters(host="a-long-host-name"), 100) == 1
    code, out, _ = orch("status", "--host", "gpu02", "--json")
    assert [d["id"] for d in json.loads(out)] == [wide, head]


def _logged(tmp_path: Path, name: str, text: str) -> str:
    root = tmp_path / "remote" / name
    root.mkdir(parents=True)
    (root / "log").write_text(text)
    (root / "result.txt").write_text(f"made by {name}\n")
    return str(root)


def test_logs_of_every_node_and_of_one(orch: Orch, store: Store, tmp_path: Path) -> None:
    head, second = multi_node(store, ["local", "local"], end=Status.SUCCEEDED,
                              r0={"remote_dir": _logged(tmp_path, "n0", "head one\nhead two\n")},
                              r1={"remote_dir": _logged(tmp_path, "n1", "worker one\nworker two")})
    code, out, _ = orch("logs", str(head))
    assert code == 0
    assert out.splitlines() == ["[0 local] head one", "[0 local] head two", "[1 local] worker one",
                                "[1 local] worker two"]
    assert orch("logs", str(head), "--node", "1")[1] == "worker one\nworker two"
    assert orch("logs", str(second), "--node", "0", "-n", "1")[1] == "head two\n"  # asked by any node's id
    assert orch("logs", str(second))[1] == "worker one\nworker two"  # a node's own id: that node's log
    doc = json.loads(orch("logs", str(head), "--json", "-n", "1")[1])
    assert [(n["rank"], n["id"], n["lines"][-1]) for n in doc["nodes"]] == [(0, head, "head two"),
                                                                            (1, second, "worker two")]
    assert doc["lines"][0] == "[0 local] head two" and doc["lines"][-1] == "[1 local] worker two"
    code, out, _ = orch("logs", str(head), "--all")
    assert code == 0 and out.count("[1 local] ") == 2 and out.startswith("[0 local] head one\n")



def test_follow_prints_each_nodes_new_lines_until_every_job_ended(orch: Orch, store: Store, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a job that ended: following reads its log to the end, then returns
    head, second = multi_node(store, ["local", "local"], end=Status.SUCCEEDED,
                              r0={"remote_dir": _logged(tmp_path, "n0", "head one\n"), "pid": gone.pid,
                                  "pid_start": "0"},
                              r1={"remote_dir": _logged(tmp_path, "n1", "worker one\n"), "pid": gone.pid,
                                  "pid_start": "0"})
    reading = runflow.read_log

    def then_more(ws: Any, store: Store, run_id: int, *args: Any) -> Any:
        found = reading(ws, store, run_id, *args)
        with open(Path(store.get_run(run_id).remote_dir or "") / "log", "a") as log:
            log.write(f"after the tail of {run_id}\n")  # written once the tail was read: only a follow shows it
        return found

    monkeypatch.setattr(runflow, "read_log", then_more)
    code, out, err = orch("logs", str(head), "-f")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) > 2, err
    assert lines[:2] == ["[0 local] head one", "[1 local] worker one"]
    assert sorted(lines[2:]) == [f"[0 local] after the tail of {head}", f"[1 local] after the tail of {second}"]


def test_logs_node_errors(orch: Orch, store: Store) -> None:
    head, _ = multi_node(store, ["gpu01", "gpu02"])
    single = make_run(store, "gpu01")
    code, _, err = orch("logs", str(head), "--node", "5")
    assert code == 2 and f"run {head} has no node 5 (its ranks: 0, 1)" in err
    code, _, err = orch("logs", str(single), "--node", "1")
    assert code == 2 and "runs on one host" in err


def test_pull_copies_each_node_into_a_folder_of_its_own(orch: Orch, store: Store, tmp_path: Path) -> None:
    head, _ = multi_node(store, ["local", "local"], end=Status.SUCCEEDED,
                         r0={"remote_dir": _logged(tmp_path, "n0", "a\n")},
                         r1={"remote_dir": _logged(tmp_path, "n1", "b\n")})
    to = tmp_path / "pulled"
    code, out, _ = orch("pull", str(head), "--to", str(to), "--json")
    assert code == 0
    doc = json.loads(out)
    assert [(n["rank"], n["files"]) for n in doc["nodes"]] == [(0, 2), (1, 2)] and doc["files"] == 4
    assert (to / "node-0" / "result.txt").read_text() == "made by n0\n"
    assert (to / "node-1" / "log").read_text() == "b\n"


def test_rm_takes_the_nodes_along_and_refuses_a_node_alone(orch: Orch, store: Store) -> None:
    head, second = multi_node(store, ["gpu01", "gpu02"], end=Status.SUCCEEDED)
    code, _, err = orch("rm", str(second))
    assert code == 2 and f"node 1 of run {head}" in err and f"orch rm {head}" in err
    code, out, _ = orch("rm", str(head), "--json")
    assert code == 0 and json.loads(out)[0]["remote"] == "no remote dir; no remote dir"
    assert store.list_runs() == [] and store.count_runs() == 0
    assert store.conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


def test_rm_refuses_a_run_whose_node_still_runs(orch: Orch, store: Store) -> None:
    head, second = multi_node(store, ["gpu01", "gpu02"], end=Status.SUCCEEDED)
    store.conn.execute("UPDATE runs SET status = 'running' WHERE id = ?", (second,))  # as a lagging watcher leaves it
    code, _, err = orch("rm", str(head))
    assert code == 2 and f"node 1 (run {second}) is running" in err
    assert len(store.nodes_of(head)) == 2


def test_cancel_of_a_node_names_the_run(orch: Orch, store: Store) -> None:
    head, second = multi_node(store, ["gpu01", "gpu02"])
    for verb in ("cancel", "stop"):
        code, _, err = orch(verb, str(second))
        assert code == 2 and f"run {second} is node 1 of run {head}: {verb} the run (`orch {verb} {head}`)" in err
    assert store.get_run(second).status is Status.RUNNING


def test_prefixed_lines_wait_for_their_end() -> None:
    written: list[bytes] = []
    lined = logs.Prefixed(b"[1 h] ", written.append)
    lined.feed(b"one\ntw")
    lined.feed(b"o\nthr")
    lined.flush()
    assert written == [b"[1 h] one\n", b"[1 h] two\n", b"[1 h] thr\n"]
