"""Hosts as folders, for tests of who holds a host without SSH: a start's take is answered by the host side's
own lease code (orchestrator/host/hostjobs/leases.py) on `<root>/<host>`, and a refusal becomes what a real
host's refusal becomes (hostlease.refused)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from pathlib import Path

from orchestrator.host import hostlease
from orchestrator.host.hostjobs import leases
from orchestrator.host.hostjobs.common import Refusal
from orchestrator.store import Store, lease
from orchestrator.store.record import RunRecord


class HostDirs:
    """The hosts of the runs of `store`, each a folder under `root`; with `local`, the one host `local` of a
    workspace whose root is `root` (its workdir is the workspace itself, as orch lays it out)."""

    def __init__(self, root: Path, store: Store, local: bool = False):
        self.root, self.store, self.local = root, store, local

    def token(self, run_id: int) -> str:
        """As hostlease.run_token names a run of the workspace whose database is the store's."""
        return f"{socket.gethostname()}:{self.store.path}:{run_id}:{self.store.created_at(run_id) or 0}"

    def workdir(self, host: str) -> Path:
        return self.root if self.local else self.root / host

    def run_dir(self, host: str, run_id: int) -> str:
        return f"{self.workdir(host)}/runs/{run_id}"

    def claim(self, hosts: Sequence[str], gpus: list[int] | None = None) -> lease.Claim:
        """The hosts' answer to a start (as runflow.starting.HostTake gives it): each host taken in turn, or
        what was taken given back and the refusal raised."""
        def take(run_ids: list[int]) -> None:
            given: list[tuple[str, int]] = []
            for host, run_id in zip(hosts, run_ids, strict=True):
                try:
                    leases.take(str(self.workdir(host)), self.run_dir(host, run_id), self.token(run_id),
                                hostlease.keys(gpus))
                except Refusal as exc:
                    for took, took_id in given:
                        leases.release(str(self.workdir(took)), self.token(took_id))
                        leases.remove(str(self.workdir(took)), self.run_dir(took, took_id), self.token(took_id))
                    raise hostlease.refused(host, self.token(run_id), gpus, exc.as_dict()) from None
                given.append((host, run_id))
        return take

    def acquire(self, hosts: Sequence[str], create: Callable[[], list[int]], gpus: list[int] | None = None,
                probe: lease.Probe | None = None) -> list[int]:
        """lease.acquire_all on these hosts; `probe` by default fails the test (none is expected)."""
        def unexpected(run: RunRecord) -> None:
            raise AssertionError(f"run {run.id} was probed")
        return lease.acquire_all(self.store, hosts, gpus, create, 30.0, probe or unexpected, self.claim(hosts, gpus))

    def release(self, run_id: int, host: str) -> None:
        """What a run's end does: its lease files gone from its host, and from this workspace's memory."""
        leases.release(str(self.workdir(host)), self.token(run_id))
        lease.release(self.store, run_id)

    def end_job(self, run_id: int, host: str) -> None:
        """The run's job ended on its host: its wrapper wrote its exit code."""
        control = Path(self.run_dir(host, run_id)) / ".orch"
        control.mkdir(parents=True, exist_ok=True)
        (control / "exit_code").write_text("0\n")
