"""Starting a run across several hosts: one record per node, every node prepared as a one-host run is, then
every rank launched with the rendezvous filled in.

The first host given is the head (rank 0): its record is the run, and its address and a port free there
now are the rendezvous every node's job finds in its environment (playbook.NODE_ENV). The hosts' leases
are taken together, all or none (lease.acquire_all), and every step that takes something on the hosts
themselves (the host's lease files, GPU cleanup, patches) goes in one fixed order, by host name: two runs
asking for the same hosts in opposite orders never hold one each while waiting for the other. A failure
on any node before the launch fails the run with nothing left running; after it, the run ends as one
(ending.end_nodes), whichever node ends first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.hosts import Host
from ..config.spec import RunSpec
from ..config.workspace import Workspace
from ..errors import OrchError, UsageError
from ..host import agent
from ..host.executor import executor_class
from ..host.hostlease import HostLeaseBusy
from ..host.polling import busy_wait_s
from ..host.remote import connect
from ..playbook import Playbook
from ..store import Store, lease
from ..store.controller import Controller
from ..store.lifecycle import transition
from ..store.record import Status
from . import watching
from .context import Run, watch_options
from .ending import cancel, end
from .look import probe_orphan
from .starting import (
    Script,
    Waiting,
    check,
    launch,
    lease_files_wait,
    open_new,
    prepare,
    take_replacing,
    wait_for_host,
)
from .watching import WatchLock


@dataclass
class Node:
    rank: int
    host: Host
    run_id: int
    lock: WatchLock
    job: Run | None = None  # once its host's agent runs
    script: Script | None = None  # once prepared

    def __str__(self) -> str:
        return f"node {self.rank} ({self.host.name})"


def check_nodes(pb: Playbook[Any], spec: RunSpec, hosts: list[Host]) -> None:
    """Refuse, before anything is touched, a set of hosts one run cannot span."""
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise UsageError(f"a host is named twice: {', '.join(names)} (a run has one node per host)")
    if spec.nodes != len(hosts):
        raise UsageError(f"nodes = {spec.nodes} but {len(hosts)} hosts are given ({', '.join(names)})")
    scheduled = [h.name for h in hosts if executor_class(h).schedules_gpus]
    if scheduled:
        raise UsageError(f"{scheduled[0]} is a cluster: its scheduler places the nodes (give it alone, with "
                         f"nodes = {spec.nodes})")


def node_env(rank: int, nodes: int, host: Host, address: str, port: int) -> dict[str, str]:
    """What the job of node `rank` (on `host`) finds in its environment: the rendezvous (playbook.NODE_ENV)
    and, where the host says which interface its ranks talk over, NCCL's and Gloo's socket interface."""
    env = {"NNODES": str(nodes), "NODE_RANK": str(rank), "MASTER_ADDR": address, "MASTER_PORT": str(port)}
    if host.ifname:
        env |= {"NCCL_SOCKET_IFNAME": host.ifname, "GLOO_SOCKET_IFNAME": host.ifname}
    return env


def rendezvous_point(head: Run) -> tuple[str, int]:
    """The head's address as the other nodes reach it, and a port free there now, as its agent found it."""
    host = head.host
    address = host.node_address or ("127.0.0.1" if host.is_local else host.address or host.name)
    return address, int(agent.call(head.transport, "port")["port"])


def start_nodes(ws: Workspace, store: Store, pb: Playbook[Any], spec: RunSpec, hosts: list[Host], *,
                queue: bool = False, on_wait: Callable[[Waiting], None] | None = None,
                run_fields: dict[str, Any] | None = None, replace: bool = False) -> Run:
    """Create the run's records with their leases (all or none; with queue, wait for all; with replace,
    stop the runs holding them first), prepare every node, launch every rank; the head's Job, which this
    process goes on watching as `start` leaves a one-host run. The other nodes are handed to their hosts'
    watchers."""
    check_nodes(pb, spec, hosts)
    for host in hosts:
        check(store, pb, spec, host)
    by_name = sorted(hosts, key=lambda h: h.name)  # the one order every taking step follows

    def create() -> list[int]:
        me, doc = str(Controller.me()), spec.model_dump(mode="json")
        ids: dict[str, int] = {}
        for rank, host in enumerate(hosts):
            ids[host.name] = store.create_run(pb.name, host.name, doc)
            own = {"node_rank": rank, **({"parent_id": ids[hosts[0].name]} if rank else run_fields or {})}
            store.update_run(ids[host.name], watcher=me, heartbeat=time.time(), **own)
        return [ids[h.name] for h in by_name]

    opts = watch_options(pb, spec, hosts[0])
    poll = (opts.poll_min, opts.poll_max)
    if pb.exclusive:
        for host in by_name:
            wait_for_host(ws, host, spec.gpus, poll, queue=queue, on_wait=on_wait)
        if replace:
            ids = take_replacing(ws, store, by_name, spec.gpus, create, poll, queue=queue, on_wait=on_wait)
        else:
            ids = lease.take(store, [h.name for h in by_name], spec.gpus, create, poll[1],
                             retry_s=busy_wait_s(poll[0]), queue=queue, on_wait=on_wait,
                             probe=lambda orphan: probe_orphan(ws, store, orphan))
    else:
        with store.tx():
            ids = create()
    run_of = dict(zip([h.name for h in by_name], ids, strict=True))
    nodes = [Node(rank, host, run_of[host.name], WatchLock(ws, run_of[host.name])) for rank, host in enumerate(hosts)]
    for node in nodes:
        node.lock.acquire()  # new runs: nobody else can hold them
        (ws.run_dir(node.run_id) / "spec.json").write_text(json.dumps(
            {"playbook": pb.name, "host": node.host.name, "node_rank": node.rank, "spec": spec.model_dump(mode="json")},
            indent=2))
        transition(store, node.run_id, Status.PREPARING)
        watching.watch_host_soon(ws, node.host)
    # queued: another workspace's run that took a host's lease files meanwhile is waited for, as for one host
    # (those of hosts earlier in the order held meanwhile: the order keeps that from ever being a cycle)
    waits = (lambda node: lease_files_wait(store, node.run_id, poll[0], on_wait)) if queue else (lambda node: None)
    try:
        _launch_all(ws, store, pb, spec, nodes, waits)
    except BaseException:
        nodes[0].lock.release()
        raise
    finally:
        for node in nodes[1:]:
            node.lock.release()  # their hosts' watchers follow them
    watching.ensure_watched(ws, store, [store.get_run(n.run_id) for n in nodes[1:]])
    head = nodes[0].job
    assert head is not None
    head.refresh()
    return head


def _launch_all(ws: Workspace, store: Store, pb: Playbook[Any], spec: RunSpec, nodes: list[Node],
                waits: Callable[[Node], Callable[[HostLeaseBusy], None] | None]) -> None:
    """Every node prepared (in host name order), then every rank launched, the head first; a failure ends
    the run (ending.end_nodes stops the ranks already launched)."""
    node: Node | None = None
    try:
        for node in sorted(nodes, key=lambda n: n.host.name):
            node.job = open_new(ws, store, pb, spec, node.host, connect(node.host), node.run_id, node.lock)
            node.script = prepare(node.job, waits(node))
        node = nodes[0]  # the rendezvous is the head's
        assert node.job is not None
        address, port = rendezvous_point(node.job)
        for node in nodes:
            assert node.job is not None and node.script is not None
            ref = launch(node.job, node.script(node_env(node.rank, len(nodes), node.host, address, port)))
            transition(store, node.run_id, Status.RUNNING, f"{ref} on {node.host.name}", **ref.columns())
            node.job.refresh()
    except BaseException as exc:
        what = str(exc) if isinstance(exc, OrchError) else f"internal error: {type(exc).__name__}: {exc}"
        _fail(store, nodes, node, what)
        raise


def _fail(store: Store, nodes: list[Node], failed: Node | None, what: str) -> None:
    """A start that failed on `failed`: that node ends failed with the reason, then every other one, naming
    it (a rank launched already is stopped, and ending.end_nodes stops the others launched)."""
    for node in sorted(nodes, key=lambda n: n is not failed):
        run = store.get_run(node.run_id)
        if run.status.terminal:
            continue
        reason = what if node is failed else f"{failed} failed: {what}"
        try:
            if run.launched and node.job is not None:
                cancel(node.job, reason, status=Status.FAILED)
            else:
                end(store, node.run_id, Status.FAILED, f"before launch: {reason}", node.job, phase=None)
        except OrchError:
            pass  # ended meanwhile, by another node's end
