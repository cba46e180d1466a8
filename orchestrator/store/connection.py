"""Opening the SQLite file: owner-only creation, a busy timeout, and WAL, so that a cron sweep and a user's
`orch` can write at the same time; and which of sqlite3's errors are the file's state rather than a bug."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

BUSY_TIMEOUT_S = 60.0  # how long a write waits for another process's transaction


def busy(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc))


def unusable(exc: sqlite3.OperationalError) -> bool:
    """Locked, read-only, not openable, full: the database's state, not a bug in a statement."""
    text = str(exc).lower()
    return busy(exc) or any(w in text for w in ("readonly", "read-only", "unable to open", "disk i/o", "is full"))


def use_wal(conn: sqlite3.Connection) -> None:
    """Switch a database to WAL once. Two processes creating it at once can meet SQLITE_BUSY here,
    which the busy timeout does not cover, so the switch is retried briefly (a read-only database
    is not: it will not change its mind). A database in WAL already (every open but its first) is left
    as it is, without the retry machinery's import."""
    try:
        if conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
            return
    except sqlite3.OperationalError as exc:
        if not busy(exc):
            raise
    import tenacity

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(busy),
        stop=tenacity.stop_after_delay(10),
        wait=tenacity.wait_random_exponential(multiplier=0.01, max=0.5),
        reraise=True,
    )
    for attempt in retrying:
        with attempt:
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode = WAL")


def create_owner_only(path: Path) -> None:
    """A new database file is its owner's alone whatever the umask (its -wal and -shm take its mode)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        pass  # there already, or not creatable here: the connect says why, in its words
