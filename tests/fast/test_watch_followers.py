"""The host watcher's end of a followed run waits for its followers, woken when the last one lets go."""

from __future__ import annotations

import threading
from pathlib import Path

from orchestrator.config.workspace import Workspace
from orchestrator.runflow.watching import FollowLock, await_followers


def test_the_end_waits_while_a_follower_holds_the_run_and_goes_on_when_it_lets_go(tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    first, second = FollowLock(ws, 7), FollowLock(ws, 7)
    assert first.acquire() and second.acquire()  # followers share the lock
    over = threading.Event()
    waiter = threading.Thread(target=lambda: (await_followers(ws, 7), over.set()))
    waiter.start()
    first.release()
    assert not over.wait(0.2)  # one follower still holds it
    second.release()
    assert over.wait(30)  # the kernel woke the wait: no timer to run out
    waiter.join()


def test_no_follower_no_wait(tmp_path: Path) -> None:
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    await_followers(ws, 3)
    assert FollowLock(ws, 3).acquire()  # and the end let go of it
