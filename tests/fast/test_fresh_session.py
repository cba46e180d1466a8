"""Each test starts with the process state of a new orch process (tests/conftest.py's fresh_session)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.host import session


def test_a_test_may_change_its_session() -> None:
    held = session.current()
    held.hosts_file = Path("elsewhere.toml")
    held.quiet_retries = True
    held.retry_notice = print


def test_the_next_test_finds_none_of_it() -> None:
    held = session.current()
    assert (held.hosts_file, held.quiet_retries, held.retry_notice) == (None, False, None)
    assert held.transports == {} and held.agent_links == {} and held.queues == {}
