"""bench/RESULTS.md holds one section per benchmark: each rewrites its own and keeps the others."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(section: str) -> None:
    """`section` starts with its `## Title` line: it replaces the section of that title, or is appended."""
    title = section.split("\n", 1)[0]
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    body = section.rstrip("\n") + "\n\n"
    pattern = re.compile(rf"^{re.escape(title)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(text):
        text = pattern.sub(lambda _: body, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + body
    RESULTS.write_text(text.rstrip("\n") + "\n")
