"""Tables of the log lines that matter, one table per engine module, each entry with the versions that print
it and where its format string lives in the engine's source.

A phase line moves the run to its phase; a metric line yields the numbers its named groups capture. Errors
are `errors.Rule`s, kept in the same modules. A new engine version is a change to these tables: a test
checks that every entry is exercised by some transcript under tests/logs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

NUM = r"(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"


class Format(NamedTuple):
    pattern: re.Pattern[str]
    role: str  # a phase ('loading', 'capturing', 'ready', 'running', 'finished') or 'metric'
    versions: str  # '0.4.10-0.5.23', '0.5.23', 'all'
    source: str  # the file in the engine's tree that prints it
    needle: str  # a literal every matching line contains: the cheap test before the pattern
    metrics: tuple[tuple[str, int, float], ...] = ()  # metric lines: (name, group, scale)


def line(pattern: str, role: str, versions: str, source: str, needle: str,
         metrics: Iterable[str | tuple[str, int, float]] = (), flags: int = 0) -> Format:
    """A table entry; a metric given by name alone is the value of the next group, unscaled."""
    named = tuple((m, i + 1, 1.0) if isinstance(m, str) else m for i, m in enumerate(metrics))
    return Format(re.compile(pattern, flags), role, versions, source, needle, named)


def phase_of(table: list[Format], text: str) -> str | None:
    """The phase of the first phase line of `table` that `text` is."""
    for f in table:
        if f.role != "metric" and f.needle in text and f.pattern.search(text):
            return f.role
    return None


def metrics_of(table: list[Format], text: str) -> list[tuple[str, float]]:
    """The numbers of every metric line of `table` that `text` is."""
    found: list[tuple[str, float]] = []
    for f in table:
        if f.role == "metric" and f.needle in text:
            m = f.pattern.search(text)
            if m:
                for name, group, scale in f.metrics:
                    value = m.group(group)
                    if value is not None:
                        found.append((name, float(value) * scale))
    return found


class Screen:
    """A large alternation behind a cheap first test: a line that contains none of `words` (lower case, looked
    for in the lowered line) cannot match, so the regular expression runs only on the few lines that might.
    Python's regex engine tries every branch at every position; `in` is a fast substring search."""

    def __init__(self, pattern: re.Pattern[str], words: Iterable[str]) -> None:
        self.pattern = pattern
        self.words = tuple(words)

    def search(self, text: str) -> re.Match[str] | None:
        low = text.lower()
        for w in self.words:
            if w in low:
                return self.pattern.search(text)
        return None


def release(version: str) -> tuple[int, ...]:
    """`0.5.5.post3` -> (0, 5, 5), `0.32.0+cpu` -> (0, 32, 0): the numeric release, enough to order versions."""
    m = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()
