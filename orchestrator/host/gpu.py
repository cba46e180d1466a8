"""GPU hygiene: what holds each GPU of a host, which orch run owns it, and freeing GPUs before a launch.

The host's agent reads both `nvidia-smi` queries and, for each process they name, its process group, user,
command line, start time, its group leader's start time and its run mark from /proc, in one request, so a
snapshot is consistent and costs one round trip. A process belongs to an orch run when its process group
id is the run's wrapper pid and that pid still has the run's recorded start time (a reused pid is never
taken for the run).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import tenacity
from tenacity.stop import stop_base

from ..errors import OrchError
from ..store.record import ACTIVE, KILL_GRACE_S
from ..store.shapes import times
from . import agent
from .remote import Transport, connect

if TYPE_CHECKING:
    from ..config.hosts import Host
    from ..store import Store

CLEANUP_TIMEOUT_S = 120.0  # how long to wait for the selected GPUs to free up
MEMORY_FREE_MIB = 1024  # a GPU with less memory in use than this (and no process) counts as free


@dataclass
class GpuProcess:
    pid: int
    gpu_index: int
    used_memory_mib: int | None
    user: str | None  # None: not visible on the host (e.g. nvidia-smi inside a container shows host pids)
    command: str | None
    pgid: int | None
    run_id: int | None = None  # the orch run the process belongs to, filled by `attribute`
    start: str | None = None  # start time of the pid, so a kill never hits a reused pid
    group_start: str | None = None  # start time of the process-group leader (None: the leader is gone)
    mark: str | None = None  # the run mark (`pid:start` of its wrapper) in the process's environment


@dataclass
class Gpu:
    index: int
    uuid: str
    memory_used_mib: int | None
    memory_total_mib: int | None
    utilization_pct: int | None
    processes: list[GpuProcess] = field(default_factory=list)


@dataclass
class GpuSnapshot:
    host: str
    gpus: list[Gpu]
    taken_at: float = field(default_factory=time.time)
    # nvidia-smi's rows as asked with `facts` (a receipt's GPU facts: model, driver, clocks), or why not
    facts: list[dict[str, str]] | None = None
    facts_error: str | None = None

    def processes(self, indices: Iterable[int] | None = None) -> list[GpuProcess]:
        wanted = None if indices is None else set(indices)
        return [p for g in self.gpus if wanted is None or g.index in wanted for p in g.processes]


# --- reading ---------------------------------------------------------------------------------------


def snapshot(transport: Transport, timeout: float = 60.0, facts: bool = False) -> GpuSnapshot | None:
    """The host's GPUs and what holds them; None when the host has no nvidia-smi (a CPU host). With `facts`,
    the same look takes a receipt's GPU facts too."""
    doc = agent.call(transport, "gpus", timeout=timeout + 10, timeout_s=timeout, **({"facts": True} if facts else {}))
    snap = parse_snapshot(transport.host.name, doc)
    if snap is not None and facts:
        snap.facts, snap.facts_error = list(doc.get("gpus") or []), doc.get("facts_error")
    return snap


def parse_snapshot(host: str, doc: dict[str, Any]) -> GpuSnapshot | None:
    """A snapshot from the agent's answer: nvidia-smi's rows (their cells as printed) and what /proc said
    of each process they name."""
    if not doc.get("nvidia_smi"):
        return None
    if doc.get("error") is not None:
        raise OrchError(f"{host}: nvidia-smi failed: {str(doc['error'])[:300] or 'no output'}")
    gpus = parse_gpus(doc.get("gpus") or [])
    procs = doc.get("procs") or {}
    by_uuid = {g.uuid: g for g in gpus}
    for pid, uuid, used in parse_apps(doc.get("apps") or []):
        gpu = by_uuid.get(uuid)
        if gpu is None:  # not one of the GPUs listed a moment earlier; nothing to attach it to
            continue
        seen = procs.get(str(pid)) or {}
        gpu.processes.append(GpuProcess(
            pid, gpu.index, used, _text(seen.get("user")), _text(seen.get("command")),
            seen.get("pgid") if isinstance(seen.get("pgid"), int) else None,
            start=_text(seen.get("start")), group_start=_text(seen.get("group_start")), mark=_text(seen.get("mark")),
        ))
    return GpuSnapshot(host, gpus)


def _text(v: object) -> str | None:
    return v if isinstance(v, str) else None


def value(text: str) -> int | None:
    """A numeric CSV cell; bracketed values such as `[N/A]` or `[Not Supported]` are None."""
    text = text.strip()
    if not text or text.startswith("["):
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return int(float(text))
        except ValueError:
            return None


def parse_gpus(rows: Iterable[dict[str, str]]) -> list[Gpu]:
    """Rows of `--query-gpu=index,uuid,memory.used,memory.total,utilization.gpu` (noheader, nounits)."""
    gpus = []
    for row in rows:
        idx = value(str(row.get("index", "")))
        if idx is not None:
            gpus.append(Gpu(idx, str(row.get("uuid", "")), value(str(row.get("memory.used", ""))),
                            value(str(row.get("memory.total", ""))), value(str(row.get("utilization.gpu", "")))))
    return sorted(gpus, key=lambda g: g.index)


def parse_apps(rows: Iterable[dict[str, str]]) -> list[tuple[int, str, int | None]]:
    """Rows of `--query-compute-apps=pid,gpu_uuid,used_memory`; no output at all means no processes."""
    apps = []
    for row in rows:
        p = value(str(row.get("pid", "")))
        if p is not None:
            apps.append((p, str(row.get("gpu_uuid", "")), value(str(row.get("used_memory", "")))))
    return apps


def _ticks(start: str | None) -> int | None:
    return int(start) if start is not None and start.isdigit() else None


def owns(run_pid: int, run_start: str | None, proc: GpuProcess) -> bool:
    """Is the process provably of the run's process group?

    With its group leader alive, the leader's start time must be the run's. A leaderless group may be
    the run's (members outliving the wrapper) or a later group that took the same id after the run's
    pid was reused: only members that started after the run's wrapper and carry its mark in their
    environment (`ORCH_JOB=pid:start`, which the wrapper sets) are the run's.
    """
    if proc.pgid != run_pid or run_start is None:
        return False
    if proc.group_start is not None:
        return proc.group_start == run_start
    began, member = _ticks(run_start), _ticks(proc.start)
    return (began is not None and member is not None and member >= began
            and proc.mark == f"{int(run_pid)}:{run_start}")


def attribute(snap: GpuSnapshot, store: Store, host_name: str) -> GpuSnapshot:
    """Fill each process's run_id from the active runs on that host (in place; returns the snapshot)."""
    runs = [r for r in store.list_runs(statuses=[s.value for s in ACTIVE], limit=100_000)
            if r.host == host_name and r.pid]
    for proc in snap.processes():
        owners = [r for r in runs if r.pid is not None and owns(r.pid, r.pid_start, proc)]
        if owners:
            proc.run_id = owners[0].id  # newest first
    return snap


def snapshot_to_dict(snap: GpuSnapshot | None) -> dict[str, Any] | None:
    return None if snap is None else asdict(snap)


def snapshots(hosts: Iterable[Host], store: Store | None = None,
              timeout: float = 60.0) -> dict[str, GpuSnapshot | None | OrchError]:
    """A snapshot per host, read in parallel; one host's failure or silence (past `timeout` seconds) is
    its entry, never the others'."""
    from .fleet import fan_out

    results = fan_out({h.name: h for h in hosts}, lambda host: snapshot(connect(host), timeout), timeout + 1)
    if store is not None:  # in this thread: the store's connection is not shared across threads
        for name, snap in results.items():
            if isinstance(snap, GpuSnapshot):
                attribute(snap, store, name)
    return results


# --- showing ---------------------------------------------------------------------------------------


def _mib(v: int | None) -> str:
    return "?" if v is None else str(v)


def describe_process(p: GpuProcess, width: int | None = 80) -> str:
    command = p.command or "command unknown: not visible on the host"
    if width is not None and len(command) > width:
        command = command[: width - 1] + "…"
    owner = f"run {p.run_id}" if p.run_id is not None else (p.user or "?")
    return f"pid {p.pid} [{owner}] {command} ({_mib(p.used_memory_mib)} MiB)"


TABLE_HEADERS = ["host", "gpu", "memory MiB", "util", "processes"]


def table_rows(snapshots_by_host: Mapping[str, GpuSnapshot | None | Exception]) -> list[list[str]]:
    """`orch gpus`: per GPU its memory, utilisation and processes; processes of orch runs show the run id."""
    rows = []
    for host, snap in snapshots_by_host.items():
        if isinstance(snap, Exception):
            rows.append([host, "", "", "", f"error: {snap}"])
        elif snap is None:
            rows.append([host, "-", "", "", "CPU host (no nvidia-smi)"])
        elif not snap.gpus:
            rows.append([host, "-", "", "", "no GPUs reported"])
        else:
            for g in snap.gpus:
                util = "?" if g.utilization_pct is None else f"{g.utilization_pct}%"
                procs = "\n".join(describe_process(p, width=None) for p in g.processes) or "-"
                rows.append([host, str(g.index), f"{_mib(g.memory_used_mib)} / {_mib(g.memory_total_mib)}", util, procs])
    return rows


def host_document(name: str, found: GpuSnapshot | None | Exception) -> dict[str, Any]:
    """A host in `orch gpus --json`: always an object, whether it answered, has no nvidia-smi, or failed."""
    doc: dict[str, Any] = {"name": name, "ok": not isinstance(found, Exception),
                           "error": str(found) if isinstance(found, Exception) else None,
                           "nvidia_smi": isinstance(found, GpuSnapshot), "gpus": []}
    if isinstance(found, GpuSnapshot):
        doc["gpus"] = asdict(found)["gpus"]
        doc.update(times(taken_at=found.taken_at))
    return doc


# --- freeing --------------------------------------------------------------------------------------


def indices_text(indices: Iterable[int]) -> str:
    return ",".join(str(i) for i in indices)


def selected_gpus(snap: GpuSnapshot, wanted: list[int] | None) -> list[int]:
    """The spec's GPUs (checked against the host's) or, by default, every GPU the host reports."""
    have = [g.index for g in snap.gpus]
    if wanted is None:
        return have
    missing = [i for i in wanted if i not in have]
    if missing:
        raise OrchError(
            f"{snap.host}: no GPU {indices_text(missing)} on this host (it has {indices_text(have) or 'none'})"
        )
    return list(wanted)


def unique(procs: list[GpuProcess]) -> list[GpuProcess]:
    """One entry per pid (a process on several GPUs has a row for each)."""
    return list({p.pid: p for p in procs}.values())


def foreign_list(procs: list[GpuProcess]) -> str:
    gpus: dict[int, list[int]] = {}
    for p in procs:
        gpus.setdefault(p.pid, []).append(p.gpu_index)
    parts = []
    for p in unique(procs):
        command = p.command or "command unknown: not visible on the host"
        where = "GPU" + ("s " if len(gpus[p.pid]) > 1 else " ") + indices_text(gpus[p.pid])
        parts.append(f"pid {p.pid} ({command[:120]}) on {where}")
    return ", ".join(parts)


def kill_pids(transport: Transport, procs: list[GpuProcess], grace_s: float = KILL_GRACE_S) -> str:
    """Stop processes through the host's agent: SIGTERM each one still alive with the start time the
    snapshot saw, a grace period, then SIGKILL; each pid's start time is checked right before its own
    signal, so a pid recycled meanwhile is left alone. Returns 'gone'|'stopped'|'killed'."""
    known = [[int(p.pid), p.start] for p in procs if p.start]  # no start time seen: nothing to prove
    if not known:
        return "gone"
    return str(agent.call(transport, "kill_pids", timeout=grace_s + 30, procs=known, grace_s=grace_s)["outcome"])


def busy_gpus(snap: GpuSnapshot, selected: Iterable[int], memory_free_mib: int) -> dict[int, str]:
    """For each selected GPU that is not free, why: its processes, or memory still in use."""
    busy = {}
    for g in snap.gpus:
        if g.index not in selected:
            continue
        if g.processes:
            busy[g.index] = "; ".join(describe_process(p) for p in g.processes)
        elif g.memory_used_mib is not None and g.memory_used_mib >= memory_free_mib:
            busy[g.index] = f"{g.memory_used_mib} MiB in use and no process listed"
    return busy


class stop_after_sleeping(stop_base):
    """Stop once the sleeps between attempts add up to `seconds`: the timeout as an injected sleep sees it."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return retry_state.idle_for >= self.seconds


def gpu_free_retry(timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> tenacity.Retrying:
    """The policy for waiting on GPUs to free: backoff from 0.5 s to 10 s, for at most `timeout_s`.

    Retries while the attempt returns (snapshot, busy) with something busy; when time runs out the last
    such result is returned rather than raised, so the caller can say what is still busy.
    """
    stop: stop_base = stop_after_sleeping(timeout_s)
    if sleep is time.sleep:  # real time also counts the snapshots; an injected sleep is the only clock
        stop = stop | tenacity.stop_after_delay(timeout_s)
    return tenacity.Retrying(
        retry=tenacity.retry_if_result(lambda result: bool(result[1])),
        stop=stop,
        wait=tenacity.wait_exponential(multiplier=0.5, max=10),
        sleep=sleep,
        retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
    )


def wait_until_free(transport: Transport, selected: list[int], *, memory_free_mib: int = MEMORY_FREE_MIB,
                    timeout_s: float = CLEANUP_TIMEOUT_S, sleep: Callable[[float], None] = time.sleep,
                    facts: bool = False) -> GpuSnapshot:
    """Poll until every selected GPU has no compute process and little memory in use; the last snapshot
    (with `facts`: each look takes a receipt's GPU facts too, so the last one has them)."""

    def check() -> tuple[GpuSnapshot, dict[int, str]]:
        snap = snapshot(transport, facts=facts)
        if snap is None:
            raise OrchError(f"{transport.host.name}: nvidia-smi disappeared while waiting for GPUs")
        return snap, busy_gpus(snap, selected, memory_free_mib)

    snap, busy = gpu_free_retry(timeout_s, sleep)(check)
    if busy:
        word = "GPUs" if len(busy) > 1 else "GPU"
        details = "; ".join(f"GPU {i}: {why}" for i, why in sorted(busy.items()))
        raise OrchError(f"{word} {indices_text(sorted(busy))} still busy after {timeout_s:g} s: {details}")
    return snap


__all__ = [
    "Gpu",
    "GpuProcess",
    "GpuSnapshot",
    "attribute",
    "host_document",
    "kill_pids",
    "parse_snapshot",
    "snapshot",
    "snapshot_to_dict",
    "snapshots",
    "table_rows",
    "wait_until_free",
]
