"""Runs across several hosts, on real sshd hosts: the rendezvous in every node's environment, the run ending
as one when any rank fails, patches on every node, leases taken all or none."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

from orchtest import FAST, Orch, alive

pytest_plugins = ["engine_src"]  # engine, other_engine: two installs of the real engine source

DEBUG = "sglang-eagle3-hidden-debug"
NO_GRAPHS = "--cuda-graph-backend-decode=disabled --cuda-graph-backend-prefill=disabled"


def two_hosts(tmp_path: Path, fleet, **fields) -> Orch:
    return Orch(tmp_path / "ws", fleet.hosts_toml(test1={"workdir": str(tmp_path / "r1"), **fields.get("test1", {})},
                                                  test2={"workdir": str(tmp_path / "r2"), **fields.get("test2", {})}))


def job_of(doc: dict) -> int:
    return int(doc["pid"])


def test_every_node_finds_the_rendezvous_and_the_run_ends_when_every_rank_did(tmp_path, ssh_fleet) -> None:
    orch = two_hosts(tmp_path, ssh_fleet, test2={"ifname": "lo"})
    res = orch("run", "command", "--host", "test1", "--host", "test2", *FAST, "--set",
               "cmd=echo rank=$NODE_RANK of $NNODES head=$MASTER_ADDR:$MASTER_PORT if=${GLOO_SOCKET_IFNAME:-none}")
    assert res.returncode == 0, res.stderr
    head, node = orch.status(1), orch.status(2)
    assert (head["status"], node["status"]) == ("succeeded", "succeeded")
    assert (head["host"], node["host"]) == ("test1", "test2")
    address = ssh_fleet.server(1).address
    node_line = orch("logs", "1", "--node", "1").stdout.strip()
    port = node_line.split(":")[-1].split()[0]
    assert int(port) > 0
    assert node_line == f"rank=1 of 2 head={address}:{port} if=lo"
    assert orch("logs", "1").stdout.splitlines() == [f"[0 test1] rank=0 of 2 head={address}:{port} if=none",
                                                     f"[1 test2] {node_line}"]
    assert [r["id"] for r in orch.status()] == [1]  # one run; its other node is listed under it
    assert orch("rerun", "1", *FAST).returncode == 0  # again on the same hosts, the head first
    assert orch.status(3)["hosts"] == ["test1", "test2"] and orch.status(3)["status"] == "succeeded"


def test_a_rank_that_dies_fails_the_run_and_stops_every_node(tmp_path, ssh_fleet) -> None:
    orch = two_hosts(tmp_path, ssh_fleet)
    gate = tmp_path / "die"
    # the head's rank hangs as a real group does when a peer dies; node 1's rank dies when the test says
    cmd = (f"echo up; if [ $NODE_RANK = 1 ]; then while [ ! -e {gate} ]; do sleep 0.05; done; "
           "echo 'RuntimeError: connection reset by peer'; exit 3; fi; sleep 300 & wait")
    res = orch("run", "command", "--host", "test1", "--host", "test2", "--detach", *FAST, "--set", f"cmd={cmd}")
    assert res.returncode == 0, res.stderr
    head = orch.wait_for(1, lambda d: d["status"] == "running")
    node = orch.wait_for(2, lambda d: d["status"] == "running")
    gate.touch()
    node = orch.wait_for(2, lambda d: d["status"] == "failed")
    head = orch.wait_for(1, lambda d: d["status"] == "failed")
    assert head["reason"].startswith("node 1 (test2) failed: exit code 3"), head["reason"]
    head = orch.wait_for(1, lambda d: any(e["kind"] == "stopped" for e in d["events"]))
    assert [e["message"] for e in head["events"] if e["kind"] == "stopped"] == ["process group: stopped"]
    assert not alive(job_of(head)) and not alive(job_of(node))
    # the head's end steps all ran, to the last
    orch.wait_for(1, lambda d: {"kind": "finished", "message": "notify"} in
                  [{"kind": e["kind"], "message": e["message"]} for e in d["events"]])


def test_the_head_stopped_stops_every_node(tmp_path, ssh_fleet) -> None:
    orch = two_hosts(tmp_path, ssh_fleet)
    res = orch("run", "command", "--host", "test1", "--host", "test2", "--detach", *FAST,
               "--set", "cmd=echo up; sleep 300 & wait")
    assert res.returncode == 0, res.stderr
    orch.wait_for(2, lambda d: d["status"] == "running")
    res = orch("cancel", "1", "--grace", "1", check=0)
    assert res.returncode == 0, res.stderr
    node = orch.wait_for(2, lambda d: d["status"] == "cancelled")
    assert node["reason"] == "the run ended on its head node (cancelled)"
    assert not alive(job_of(orch.status(1))) and not alive(job_of(node))


def test_patch_sets_go_on_every_node_and_come_off_every_node(tmp_path, ssh_fleet, engine, other_engine) -> None:
    orch = two_hosts(tmp_path, ssh_fleet, test1={"python": engine.python}, test2={"python": other_engine.python})
    before = (engine.snapshot("sglang"), other_engine.snapshot("sglang"))
    cmd = f"cmd=echo serving {NO_GRAPHS}"
    res = orch("run", "command", "--host", "test1", "--host", "test2", *FAST, "--set", cmd,
               "--set", f'patches=["{DEBUG}"]')
    assert res.returncode == 0, res.stderr
    for run_id, python in ((1, engine.python), (2, other_engine.python)):
        events = [e for e in orch.status(run_id)["events"] if e["kind"] == "patch"]
        assert "applied" in events[0]["message"] and events[0]["data"]["python"] == python
        assert "reverted" in events[1]["message"]
    assert (engine.snapshot("sglang"), other_engine.snapshot("sglang")) == before


def test_a_node_that_cannot_be_prepared_fails_the_run_before_any_rank_starts(tmp_path, ssh_fleet, engine,
                                                                           other_engine) -> None:
    orch = two_hosts(tmp_path, ssh_fleet, test1={"python": engine.python}, test2={"python": other_engine.python})
    target = other_engine.path("sglang/srt/models/llama_eagle3.py")
    target.write_text(target.read_text().replace("        hidden_states = forward_batch.spec_info.hidden_states\n",
                                                 "        hidden_states = forward_batch.spec_info.hidden_states  # edited\n", 1))
    before = (engine.snapshot("sglang"), other_engine.snapshot("sglang"))
    marker = tmp_path / "started"
    res = orch("run", "command", "--host", "test1", "--host", "test2", *FAST,
               "--set", f"cmd=touch {marker}-$NODE_RANK; echo {NO_GRAPHS}", "--set", f'patches=["{DEBUG}"]', check=2)
    assert "llama_eagle3.py" in res.stderr
    head, node = orch.status(1), orch.status(2)
    assert node["status"] == "failed" and node["reason"].startswith("before launch:") and node["pid"] is None
    assert head["status"] == "failed" and head["reason"].startswith("before launch: node 1 (test2) failed:")
    assert head["pid"] is None and not list(tmp_path.glob("started-*"))
    assert (engine.snapshot("sglang"), other_engine.snapshot("sglang")) == before  # node 0's set taken off again
    res = orch("run", "command", "--host", "test1", "--set", "cmd=true", *FAST)  # no lease left behind
    assert res.returncode == 0, res.stderr


def test_two_runs_asking_for_the_same_hosts_in_opposite_orders_never_deadlock(tmp_path, ssh_fleet) -> None:
    orch = two_hosts(tmp_path, ssh_fleet)
    gate = tmp_path / "go"
    cmd = f"cmd=touch {tmp_path}/up-$$; while [ ! -e {gate} ]; do sleep 0.05; done"
    first = orch("run", "command", "--host", "test1", "--host", "test2", "--detach", *FAST, "--set", cmd)
    assert first.returncode == 0, first.stderr
    refused = orch("run", "command", "--host", "test2", "--host", "test1", *FAST, "--set", "cmd=true", check=1)
    assert "busy with run 1" in refused.stderr and "--queue waits" in refused.stderr
    assert len(orch.status()) == 1  # the refused run was never made
    # both orders queued at once behind the first: each gets both hosts in turn
    results: dict[str, object] = {}

    def queued(name: str, hosts: list[str]) -> None:
        args = [a for h in hosts for a in ("--host", h)]
        results[name] = orch("run", "command", *args, "--queue", *FAST, "--set", "cmd=sleep 0.5",
                             new_process=True, check=0, timeout=180)

    threads = [threading.Thread(target=queued, args=("a", ["test1", "test2"])),
               threading.Thread(target=queued, args=("b", ["test2", "test1"]))]
    for t in threads:
        t.start()
    time.sleep(1)
    gate.touch()
    for t in threads:
        t.join(timeout=200)
    assert all(r.returncode == 0 for r in results.values()), {k: r.stderr for k, r in results.items()}
    runs = [d for d in orch.status() if d["id"] != 1]
    assert [d["status"] for d in runs] == ["succeeded", "succeeded"]
    spans = sorted((orch.status(d["id"])["started_at"], orch.status(d["id"])["ended_at"]) for d in runs)
    assert spans[0][1] <= spans[1][0]  # one after the other, never both on a host



def test_replace_stops_a_run_across_hosts_as_a_whole_whichever_host_it_is_asked_for(tmp_path, ssh_fleet) -> None:
    orch = two_hosts(tmp_path, ssh_fleet)
    res = orch("run", "command", "--host", "test1", "--host", "test2", "--detach", *FAST,
               "--set", "cmd=sleep 300 & wait")
    assert res.returncode == 0, res.stderr
    first = [job_of(orch.wait_for(i, lambda d: d["status"] == "running")) for i in (1, 2)]
    # one host of the two, asked for alone: the whole run is stopped, through its head
    res = orch("run", "command", "--host", "test2", "--replace", "--detach", *FAST, "--set", "cmd=sleep 300 & wait")
    assert res.returncode == 0, res.stderr
    head, node = orch.status(1), orch.wait_for(2, lambda d: d["status"] == "cancelled")
    assert (head["status"], head["reason"]) == ("cancelled", "replaced by run 3")
    assert node["reason"] == "the run ended on its head node (cancelled)"
    assert not any(alive(pid) for pid in first)
    single = job_of(orch.wait_for(3, lambda d: d["status"] == "running"))
    # both hosts, in the other order: the one-host run holding one of them is stopped, then both leases taken
    res = orch("run", "command", "--host", "test2", "--host", "test1", "--replace", *FAST, "--set", "cmd=true")
    assert res.returncode == 0, res.stderr
    assert (orch.status(3)["status"], orch.status(3)["reason"]) == ("cancelled", "replaced by run 4")
    assert not alive(single)
    new = orch.status(4)
    assert new["status"] == "succeeded" and new["hosts"] == ["test2", "test1"]
    replaced = [e["message"] for r in (3, 4) for e in orch.status(r)["events"] if e["kind"] == "replaced"]
    assert [m.split(": process group stopped")[0] for m in replaced] == ["run 1 (command)", "run 3 (command)"]


def test_a_sweep_runs_points_across_hosts_each_on_all_of_them_one_at_a_time(tmp_path, ssh_fleet) -> None:
    orch = two_hosts(tmp_path, ssh_fleet)
    path = tmp_path / "s.toml"
    path.write_text("""
name = "spread"
playbook = "command"
hosts = ["test1", "test2"]
[spec]
cmd = 'echo "$A rank=$NODE_RANK"; sleep 0.3'
nodes = 2
poll_min = 0.05
poll_max = 0.3
[matrix]
"env.A" = ["x", "y", "z"]
""")
    res = orch("sweep", "run", str(path), timeout=180)
    assert res.returncode == 0, res.stderr
    heads = orch.status()
    assert len(heads) == 3 and all(d["status"] == "succeeded" for d in heads)
    spans = []
    for head in heads:
        doc = orch.status(head["id"])
        assert sorted(n["host"] for n in doc["nodes"]) == ["test1", "test2"]
        assert all(n["status"] == "succeeded" for n in doc["nodes"])
        spans.append((doc["started_at"], doc["ended_at"]))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # each point held both hosts alone
