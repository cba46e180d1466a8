"""Shared pytest fixtures."""

from __future__ import annotations

from typing import Iterator

import pytest

from orchestrator.hosts import Host

from sshd import SSHFleet  # tests/ is on sys.path (rootdir-relative, no __init__.py)

# ---------------------------------------------------------------------------------------------------
# Real OpenSSH servers on loopback (tests/sshd.py)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ssh_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHFleet]:
    """Two running sshd servers, test1 and test2, shared by the whole session; stopped at its end."""
    fleet = SSHFleet(2, root=tmp_path_factory.mktemp("sshd"))
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop_all()


@pytest.fixture
def ssh_fleet_restarts(ssh_fleet: SSHFleet) -> Iterator[SSHFleet]:
    """The session fleet, for a test that stops servers: any it left stopped is started again after."""
    yield ssh_fleet
    for server in ssh_fleet.servers:
        if not server.running:
            server.start()


@pytest.fixture
def ssh_host(ssh_fleet: SSHFleet) -> Host:
    """The `Host` for server 1 of the fleet (name test1), with strict host-key checking."""
    return Host(name="test1", **ssh_fleet.host_entry(1))
