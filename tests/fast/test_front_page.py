"""The README is a front page: short, and every page it links to is there (the manual under docs/ is
checked by `make docs`, which builds it with --strict; the README is not part of that build)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_the_front_page_stays_a_front_page() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_every_link_of_the_front_page_reaches_a_page_and_its_heading() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the front page links to the manual"
    for link in local:
        path, _, anchor = link.partition("#")
        page = ROOT / path
        assert page.is_file(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)
            assert anchor in {slug(h) for h in headings}, link


def slug(heading: str) -> str:
    """The anchor MkDocs (and GitHub) give a heading: lower case, punctuation gone, spaces as dashes."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[\s]+", "-", text)
