"""A run across several hosts, in process: which hosts it spans, what it refuses before anything, its
leases taken all or none, its dry run showing every node's steps and command, and how one node's end
ends the others (ending.end_nodes)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hostdirs import HostDirs

from orchestrator import runflow
from orchestrator.config.hosts import Inventory
from orchestrator.config.workspace import Workspace
from orchestrator.errors import UsageError
from orchestrator.runflow import ending
from orchestrator.runflow.nodes import check_nodes, node_env
from orchestrator.store import Store, lease
from orchestrator.store.lifecycle import transition
from orchestrator.store.record import Status
from playbooks.command import Command, CommandSpec
from playbooks.serve_eagle3 import ServeEagle3
from playbooks.train_draft import TrainDraft

HOSTS = """
[hosts.gpu01]
address = "10.0.0.1"
tags = ["h100"]
[hosts.gpu02]
address = "10.0.0.2"
node_address = "192.168.7.2"
tags = ["h100"]
ifname = "ib0"
[hosts.gpu03]
address = "10.0.0.3"
tags = ["h100"]
[hosts.cluster]
scheduler = "slurm"
"""


@pytest.fixture
def inv(tmp_path: Path) -> Inventory:
    (tmp_path / "hosts.toml").write_text(HOSTS)
    return Inventory.load(tmp_path / "hosts.toml", tmp_path)


def test_hosts_named_or_tagged_head_first(inv: Inventory) -> None:
    assert [h.name for h in inv.for_run(["gpu03", "gpu01"], 2)] == ["gpu03", "gpu01"]
    assert [h.name for h in inv.for_run(["@h100"], 2)] == ["gpu01", "gpu02"]
    assert [h.name for h in inv.for_run(["cluster"], 4)] == ["cluster"]  # the scheduler places the nodes
    with pytest.raises(UsageError, match="nodes = 4 but 3 hosts have the tag 'h100'"):
        inv.for_run(["@h100"], 4)
    with pytest.raises(UsageError, match="nodes = 2 needs as many hosts"):
        inv.for_run(["gpu01"], 2)


@pytest.mark.parametrize(("pb", "hosts", "nodes", "message"), [
    (Command(), ["gpu01", "gpu01"], 2, "a host is named twice"),
    (Command(), ["gpu01", "gpu02"], 3, "nodes = 3 but 2 hosts are given"),
    (Command(), ["gpu01", "cluster"], 2, "cluster is a cluster"),
])
def test_what_a_run_across_hosts_refuses(inv: Inventory, pb, hosts, nodes, message) -> None:
    with pytest.raises(UsageError, match=message):
        check_nodes(pb, CommandSpec(cmd="true", nodes=nodes), [inv.hosts[h] for h in hosts])


def test_a_playbook_of_one_host_refuses_to_span_several(tmp_path: Path, inv: Inventory) -> None:
    class OneHost(Command):
        name = "one-host"
        multi_node = False

    store = Store(tmp_path / "orch.db")
    store.migrate()
    for host in ("gpu01", "cluster"):  # across hosts, or across a cluster's nodes
        with pytest.raises(UsageError, match="one-host runs on one host; it cannot span 2 nodes"):
            runflow.check(store, OneHost(), CommandSpec(cmd="true", nodes=2), inv.hosts[host])
    runflow.check(store, OneHost(), CommandSpec(cmd="true"), inv.hosts["gpu01"])
    assert ServeEagle3.multi_node and TrainDraft.multi_node


def test_every_node_gets_the_rendezvous_and_its_own_interface(inv: Inventory) -> None:
    assert node_env(0, 2, inv.hosts["gpu01"], "10.0.0.1", 4242) == {
        "NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4242"}
    assert node_env(1, 2, inv.hosts["gpu02"], "10.0.0.1", 4242) == {
        "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4242",
        "NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}


def test_leases_are_taken_all_or_none_whatever_the_order(tmp_path: Path) -> None:
    store = Store(tmp_path / "orch.db")
    store.migrate()

    def records(*hosts: str):
        return lambda: [store.create_run("command", h, {}) for h in hosts]

    at = HostDirs(tmp_path, store)
    [held] = at.acquire(["b"], records("b"))
    for hosts in (["a", "b"], ["b", "a"], ["c", "b", "a"]):
        with pytest.raises(lease.Busy, match=f"busy with run {held}"):
            at.acquire(hosts, records(*hosts))
    assert [l.host for l in lease.held(store)] == ["b"] and store.newest_run_id() == held  # nothing taken, made
    assert not list((tmp_path / "c" / "leases").glob("host"))  # the host taken before the refusal, given back
    assert len(at.acquire(["a", "c"], records("a", "c"))) == 2
    assert sorted(l.host for l in lease.held(store)) == ["a", "b", "c"]
    with pytest.raises(lease.Busy):  # a GPU set of a held host, beside a free one: neither taken
        at.acquire(["d", "a"], records("d", "a"), [4, 5])
    assert "d" not in {l.host for l in lease.held(store)} and not list((tmp_path / "d" / "leases").glob("gpu-*"))


def test_a_host_held_by_a_node_of_a_run_across_hosts_names_that_run(tmp_path: Path) -> None:
    """The lease of the second host is its node's record: a person is told the run (its head) to watch,
    cancel or replace, and which node holds the host."""
    store = Store(tmp_path / "orch.db")
    store.migrate()

    def a_run_across(*hosts: str):
        def create() -> list[int]:
            head, *others = [store.create_run("command", h, {}) for h in hosts]
            store.update_run(head, node_rank=0)
            for rank, node in enumerate(others, 1):
                store.update_run(node, parent_id=head, node_rank=rank)
            return [head, *others]
        return create

    at = HostDirs(tmp_path, store)
    head, node = at.acquire(["a", "b"], a_run_across("a", "b"))
    for status in (Status.PREPARING, Status.LAUNCHING, Status.RUNNING):
        for run_id in (head, node):
            transition(store, run_id, status)
    with pytest.raises(lease.Busy) as busy:
        at.acquire(["b"], lambda: [store.create_run("command", "b", {})])
    assert f"host b is busy with run {head} (" in str(busy.value) and f"run {node}" not in str(busy.value)
    said = runflow.busy_message(store, busy.value)
    assert said.startswith(f"host b is busy with run {head} (command, running"), said
    assert ", its node 1 on b" in said and f"run {node}" not in said


def test_the_dry_run_shows_every_nodes_steps_and_command(tmp_path: Path, inv: Inventory) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    store.migrate()
    spec = CommandSpec(cmd='echo "$NODE_RANK"', nodes=2)
    dry = runflow.dry_run(ws, store, Command(), spec, [inv.hosts["gpu02"], inv.hosts["gpu01"]])
    launches = [s for s in dry.steps if s.request.get("op") == "launch"]
    assert [s.host for s in launches] == ["gpu02", "gpu01"]  # the head first
    scripts = [str(s.request["script"]) for s in launches]
    assert "export NODE_RANK=0\n" in scripts[0] and "export NODE_RANK=1\n" in scripts[1]
    assert all("export MASTER_ADDR=192.168.7.2\n" in s and "export NNODES=2\n" in s for s in scripts)
    assert "export GLOO_SOCKET_IFNAME=ib0\n" in scripts[0] and "IFNAME" not in scripts[1]
    takes = [s.host for s in dry.steps if "take the lease files" in s.what]
    assert takes == ["gpu01", "gpu02"]  # the hosts' own leases in the one fixed order
    text = dry.text()
    assert "on gpu02, gpu01" in text and "MASTER_PORT 29500 stands in" in text
    assert store.newest_run_id() == 0  # nothing created


class Ended:
    """ending._end_node as the tests see it: which node was ended, how and why."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[tuple[int, str, str]] = []
        monkeypatch.setattr(ending, "_end_node", lambda run, node, status, reason:
                            self.calls.append((node.id, status.value, reason)))


def node_records(store: Store, launched: list[bool]) -> list[int]:
    """A run's records on hosts h0, h1, ...: running with a job where `launched`, else preparing."""
    ids: list[int] = []
    for rank, up in enumerate(launched):
        run_id = store.create_run("command", f"h{rank}", {})
        store.update_run(run_id, node_rank=rank, **({"parent_id": ids[0]} if rank else {}))
        transition(store, run_id, Status.PREPARING)
        if up:
            transition(store, run_id, Status.LAUNCHING)
            transition(store, run_id, Status.RUNNING, pid=4000 + rank, pid_start="1")
        ids.append(run_id)
    return ids


def ending_of(store: Store, run_id: int, status: Status, reason: str) -> SimpleNamespace:
    transition(store, run_id, status, reason)
    return SimpleNamespace(record=store.get_run(run_id), store=store)


@pytest.fixture
def records(tmp_path: Path) -> Store:
    store = Store(tmp_path / "orch.db")
    store.migrate()
    return store


def test_a_node_that_fails_fails_the_run(records: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    ended = Ended(monkeypatch)
    head, node = node_records(records, [True, True])
    ending.end_nodes(ending_of(records, node, Status.FAILED, "exit code 3"))  # type: ignore[arg-type]
    assert ended.calls == [(head, "failed", "node 1 (h1) failed: exit code 3")]


def test_a_node_whose_starter_died_before_its_launch_fails_a_launched_head(records: Store,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ended = Ended(monkeypatch)
    head, node = node_records(records, [True, False])
    ending.end_nodes(ending_of(records, node, Status.FAILED, "its controller died before launch (preparing)"))  # type: ignore[arg-type]
    assert ended.calls == [(head, "failed", "node 1 (h1) failed: its controller died before launch (preparing)")]


def test_before_the_heads_launch_the_nodes_are_their_starters_to_end(records: Store,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ended = Ended(monkeypatch)
    head, node = node_records(records, [False, False])
    ending.end_nodes(ending_of(records, node, Status.FAILED, "before launch: a patch does not apply"))  # type: ignore[arg-type]
    ending.end_nodes(ending_of(records, head, Status.FAILED, "before launch: node 1 (h1) failed"))  # type: ignore[arg-type]
    assert ended.calls == []


def test_a_node_that_ended_well_leaves_the_run_to_its_head(records: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    ended = Ended(monkeypatch)
    _, node = node_records(records, [True, True])
    ending.end_nodes(ending_of(records, node, Status.SUCCEEDED, "exit code 0"))  # type: ignore[arg-type]
    assert ended.calls == []


def test_the_heads_end_stops_the_other_launched_nodes(records: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    ended = Ended(monkeypatch)
    head, up, done, _never = node_records(records, [True, True, True, False])
    transition(records, done, Status.SUCCEEDED, "exit code 0")
    ending.end_nodes(ending_of(records, head, Status.CANCELLED, "cancelled by user"))  # type: ignore[arg-type]
    assert ended.calls == [(up, "cancelled", "the run ended on its head node (cancelled)")]


def test_a_head_that_ended_well_gives_the_others_time_to_end_by_themselves(records: Store,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ended = Ended(monkeypatch)
    head, slow, stuck = node_records(records, [True, True, True])
    looks: list[float] = []

    def sleep(s: float) -> None:  # the slow rank ends during the second look; the stuck one never does
        looks.append(s)
        time.sleep(min(s, 0.05))
        if len(looks) == 2:
            transition(records, slow, Status.SUCCEEDED, "exit code 0")

    monkeypatch.setattr(ending, "NODES_GRACE_S", 0.5)
    ending.end_nodes(ending_of(records, head, Status.SUCCEEDED, "exit code 0"), sleep)  # type: ignore[arg-type]
    assert ended.calls == [(stuck, "cancelled", "the run ended on its head node (succeeded)")]
    assert len(looks) >= 2


def test_the_heads_end_waits_for_a_node_another_process_is_finishing(records: Store, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    head, node = node_records(records, [True, True])
    HostDirs(tmp_path, records).acquire(["h1"], lambda: [node])
    # the node's host watcher ended it first and is still reading its log to the end: the lease is its
    monkeypatch.setattr(ending, "_end_node", lambda run, n, status, reason: transition(records, n.id, status, reason))
    finished: list[float] = []

    def sleep(s: float) -> None:
        time.sleep(min(s, 0.05))
        if not finished:  # the watcher's finish is over: the lease is released
            finished.append(s)
            lease.release(records, node)

    ending.end_nodes(ending_of(records, head, Status.CANCELLED, "stopped by user"), sleep)  # type: ignore[arg-type]
    assert finished and lease.held(records, "h1") == []


def test_the_heads_end_never_waits_for_the_node_whose_own_finish_ended_it(records: Store, tmp_path: Path) -> None:
    head, node = node_records(records, [True, True])
    HostDirs(tmp_path, records).acquire(["h1"], lambda: [node])
    transition(records, node, Status.FAILED, "exit code 3")  # its lease is freed once its finish returns
    finishing = ending._FINISHING.set(frozenset({node}))
    try:
        ending.end_nodes(ending_of(records, head, Status.FAILED, "node 1 (h1) failed: exit code 3"),  # type: ignore[arg-type]
                         lambda s: pytest.fail("the head's end waited for the node whose finish it is in"))
    finally:
        ending._FINISHING.reset(finishing)
