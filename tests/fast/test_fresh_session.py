"""Each test starts with the process state of a new orch process (tests/conftest.py's fresh_session), its
host session in it."""

from __future__ import annotations

from pathlib import Path

from orchestrator import state
from orchestrator.config import metricinfo
from orchestrator.host import session
from orchestrator.runflow import notify, registry
from orchestrator.store import runtables


def test_a_test_may_change_its_session() -> None:
    held = session.current()
    held.hosts_file = Path("elsewhere.toml")
    held.quiet_retries = True
    held.retry_notice = print


def test_the_next_test_finds_none_of_it() -> None:
    assert state.current().host_session is None
    held = session.current()
    assert state.current().host_session is held
    assert (held.hosts_file, held.quiet_retries, held.retry_notice) == (None, False, None)
    assert held.transports == {} and held.agent_links == {} and held.queues == {}


def test_a_test_may_leave_what_a_process_learns(tmp_path: Path) -> None:
    metricinfo.declare("my-bench", ["score"])
    registry.playbook("command")
    registry.patch_sets(root=tmp_path)
    runtables.installed()
    notify.send(["http://127.0.0.1:9/"], {}, lambda url, error: None, total_s=0.01)
    held = state.current()
    assert held.headlines and held.playbooks and held.playbook_targets and held.patch_set_dirs is not None
    assert held.run_tables is not None and held.notify_sends


def test_the_next_test_finds_a_new_process_state() -> None:
    assert state.current() == state.State()  # its host session too: made on first use
    assert metricinfo.headlines("my-bench") == ()
