"""Shared pytest fixtures."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from nethosts import NetHosts
from orchtest import Orch, stop_background_watchers
from sshd import SSHFleet  # tests/ is on sys.path (rootdir-relative, no __init__.py)

from orchestrator import state
from orchestrator.config.hosts import Host
from orchestrator.config.workspace import Workspace
from orchestrator.store import Store

# ---------------------------------------------------------------------------------------------------
# Nothing of the user running the tests: HOME (~/.ssh config, keys and known_hosts, ~/.fabric.yaml),
# the ssh-agent and the crontab are the tests' own. Subprocesses inherit os.environ.
# ---------------------------------------------------------------------------------------------------
PRIVATE_ENV_UNSET = ("SSH_AUTH_SOCK", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")


def _isolate(mp: pytest.MonkeyPatch, home: Path) -> None:
    mp.setenv("HOME", str(home))
    for name in PRIVATE_ENV_UNSET:
        mp.delenv(name, raising=False)
    mp.setenv("ORCH_CRONTAB", str(home / "crontab"))  # python-crontab's tab file, never the real one


@pytest.fixture(scope="session", autouse=True)
def _session_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """For session- and module-scoped fixtures, which start before any test's own HOME."""
    with pytest.MonkeyPatch.context() as mp:
        home = tmp_path_factory.mktemp("session-home")
        _isolate(mp, home)
        yield home


@pytest.fixture(autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets an empty HOME of its own; background watchers it left behind end with it."""
    home = tmp_path_factory.mktemp("home")
    _isolate(monkeypatch, home)
    yield home
    stop_background_watchers(home)


@pytest.fixture(autouse=True)
def fresh_session() -> Iterator[state.State]:
    """Every test starts with the process state of a new orch process (orchestrator/state.py): no plugin
    found or loaded, headline declared or notification in flight, and no connection, agent link, queue or
    option that an earlier test left (its host session). Its connections are closed after it, as a
    process's are when it ends."""
    with state.fresh() as held:
        yield held
        if "orchestrator.host.remote" in sys.modules:  # (a test that reached no host skips the import)
            sys.modules["orchestrator.host.remote"].close_all()


@pytest.fixture(autouse=True)
def ctrl_c_interrupts() -> Iterator[None]:
    """Every test starts with Ctrl-C as a new Python process has it (KeyboardInterrupt), whatever an earlier
    test's in-process `run` left: an ignored SIGINT would be inherited by the processes a test starts, and
    one told to stop by Ctrl-C would never stop."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    """A workspace of the test's own (no hosts.toml: the built-in `local` host only)."""
    return Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")


@pytest.fixture
def store(ws: Workspace) -> Iterator[Store]:
    s = Store(ws.db_path)
    yield s
    s.close()


# ---------------------------------------------------------------------------------------------------
# Real OpenSSH servers on loopback (tests/sshd.py)
# ---------------------------------------------------------------------------------------------------


def worker_index() -> int:
    """0, or N for pytest-xdist's worker gwN: what this process may use of the machine's shared things."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


@pytest.fixture(scope="session")
def ssh_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHFleet]:
    """Two running sshd servers, test1 and test2, shared by the whole session; stopped at its end. Each
    worker of a parallel run has loopback addresses of its own (127.0.0.2-3, 127.0.0.22-23, ...), so a
    server stopped and started again on its port never finds it taken by another worker's."""
    fleet = SSHFleet(2, root=tmp_path_factory.mktemp("sshd"), first_address=2 + 20 * worker_index())
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


# ---------------------------------------------------------------------------------------------------
# The `orch` command in a workspace of the test's own (tests/orchtest.py)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def orch_hosts(tmp_path: Path, ssh_fleet: SSHFleet) -> str:
    """The hosts.toml of the `orch` fixture: the session fleet's test1 and test2, each with a workdir of the
    test's own (tmp_path/remote1, tmp_path/remote2). A test module that needs other hosts overrides this
    fixture (`return ""`: the built-in `local` host only; a Slurm cluster's table; ...)."""
    overrides = {f"test{i}": {"workdir": str(tmp_path / f"remote{i}")} for i in (1, 2)}
    return ssh_fleet.hosts_toml(**overrides)


@pytest.fixture
def orch(tmp_path: Path, orch_hosts: str) -> Orch:
    """`orch ARGS` in a workspace of the test's own (tmp_path/ws) whose hosts.toml is `orch_hosts`."""
    return Orch(tmp_path / "ws", orch_hosts)


# ---------------------------------------------------------------------------------------------------
# Hosts of their own: network namespaces on a bridge, each with a real sshd (tests/nethosts.py)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def net_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[int], NetHosts]]:
    """A factory: `net_hosts(n)` gives n running hosts net1..netN, each in a network namespace of its own
    with its own address and sshd; the hosts reach each other and this process reaches them. Everything
    is removed after the test."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("network namespaces need iproute2's `ip`")
    made: list[NetHosts] = []

    def make(n: int = 2) -> NetHosts:
        hosts = NetHosts(n, root=tmp_path_factory.mktemp("nethosts"))
        made.append(hosts)
        return hosts.start()

    yield make
    for hosts in made:
        hosts.close()


# ---------------------------------------------------------------------------------------------------
# The real vLLM (tests/test_vllm_*.py) runs in two units of work, each on one worker: one server serves at a
# time in each (a server takes about 2 GiB and a core; starts that only fail are launched together,
# test_vllm_real.py). They are the longest units by far (about 40 % of the suite's CPU in few tests), so they
# go out first: xdist hands out files by their number of tests, which would start them last and leave the
# other workers idle while one runs them alone. The files next in length go out right after them, longest
# first: a file of few slow tests handed out last would be the end of the run for one worker while the
# others have nothing left to do.
# ---------------------------------------------------------------------------------------------------

# the two units, of about the same length: the servers that serve benchmarks or fail to start; the rest (the
# EAGLE-3 loop, the speculators extraction, the patch probes, any new file). They run at the same time, their
# engines bound to no core (vllm_threads below).
SERVING, LOOP = "the real vLLM serving", "the real vLLM loop"
SERVING_FILES = ("test_vllm_numbers.py", "test_vllm_real.py")
# Each of these takes a minute or more of one worker (Slurm's whole-minute time limit, a browser, hosts gone
# dark, sweeps and searches over real hosts), longest first; a file missing here only goes out later.
LONGEST_FIRST = ("test_slurm.py", "test_faults.py", "test_ui.py", "test_sweep.py", "test_sweep_search.py",
                 "test_live.py", "test_cli.py", "test_extract_job.py", "test_serve.py")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: pytest runs without it too (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RealEngineFirst(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            name = Path(scope).name
            if not name.startswith("test_vllm_"):
                return scope
            return SERVING if name in SERVING_FILES else LOOP

        def _assign_work_unit(self, node: Any) -> None:
            first = {Path(scope).name: scope for scope in self.workqueue}
            for name in reversed((SERVING, LOOP, *LONGEST_FIRST)):
                if name in first:
                    self.workqueue.move_to_end(first[name], last=False)
            super()._assign_work_unit(node)

    return RealEngineFirst(config, log)


@pytest.fixture(scope="module", autouse=True)
def vllm_threads(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every engine a test_vllm_ file starts computes on one thread bound to no core. By itself vLLM binds its
    thread to the first core: the two units' engines would share it, and a benchmark's throughput would halve
    whenever the other engine computes (two nights of one server then differ by that, far beyond their own
    spread). Bound to one core of its own, an engine halves instead whenever the kernel leaves another busy
    process on that core. Unbound, the kernel shares both cores among all that runs, so what else runs (the
    other unit, other tests, a loaded machine) slows every benchmark alike."""
    if not request.path.name.startswith("test_vllm_"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:  # the launched engines inherit the environment
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        mp.setenv("OMP_NUM_THREADS", "1")
        yield
