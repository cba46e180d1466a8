"""How the CLI shows things: the two consoles, JSON, tables, the progress line, ages."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Self

from rich.console import Console

from ..store.encoding import json_safe


def consoles() -> tuple[Console, Console]:
    """The stdout and stderr consoles, as the terminal and the environment (COLUMNS, NO_COLOR, ...) are
    now. No markup: run output, log lines and error messages are data, and `[rank3]` must print as itself."""
    return (Console(highlight=False, soft_wrap=True, markup=False),
            Console(stderr=True, highlight=False, soft_wrap=True, markup=False))


out, err = consoles()


def emit_json(value: Any) -> None:
    """Strict JSON: a NaN or an infinity as the string "NaN", "Infinity" or "-Infinity" (never a bare token
    other readers refuse, never null: it is a finding)."""
    sys.stdout.write(json.dumps(json_safe(value), indent=2, default=str, allow_nan=False) + "\n")


@contextlib.contextmanager
def transfer_bar(what: str, total: int) -> Iterator[Callable[[int], object]]:
    """A bar on stderr for a file transfer (orch pull, a large upload): bytes, rate and time left; gone
    once the transfer ends. Where another live display is on the screen (a run being followed) and this
    rich cannot nest one in it, the transfer goes unshown."""
    from rich.errors import LiveError
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                   TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=True)
    try:
        bar.start()
    except LiveError:
        yield lambda n: None
        return
    try:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)
    finally:
        bar.stop()


def progress_line(progress: dict[str, Any] | None, phase: str | None) -> str:
    p = progress or {}
    phase = phase or "?"
    if not p:
        return f"{phase}"
    total = p.get("total")
    frac = (p["done"] / total) if total else None
    bar = ""
    if frac is not None:
        filled = int(30 * min(max(frac, 0), 1))
        bar = "" + "█" * filled + "" + "░" * (30 - filled) + f" {100 * frac:5.1f}% "
    eta = f" eta {p['eta_s']:.0f}s" if p.get("eta_s") is not None else ""
    rate = f" {p['rate_per_s']:.2f}/s" if p.get("rate_per_s") else ""
    done = f"{p['done']:g}/{total:g}" if total else f"{p['done']:g}"
    return f"{phase} {p.get('label') or ''} {bar}{done}{rate}{eta}"


class Styled(str):
    """A table value coloured on a terminal (off one, its plain text)."""

    style: str | None = None

    def __new__(cls, text: str, style: str | None) -> Self:
        obj = super().__new__(cls, text)
        obj.style = style
        return obj


BETTER, WORSE = "green", "red"


def cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value  # a Styled value keeps its colour
    return ", ".join(map(str, value)) if isinstance(value, list) else str(value)


def age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


_BOUNDARY = " ,;=/-_"  # where a shortened value may end: never inside a word


def shorten(text: str, width: int) -> str:
    """`text` in at most `width` columns: cut after its last word, space or separator that fits, and `…`.
    A Styled value keeps its colour."""
    if len(text) <= width:
        return text
    room = text[:max(width - 1, 0)]
    at = room.rfind(" ")  # after a whole word (a metric and its value) where one fits, else a separator
    if at < width // 3:
        at = max(room.rfind(c) for c in _BOUNDARY)
    kept = room[:at + 1] if at >= width // 3 else room
    short = (kept if kept.endswith(" ") else kept.rstrip()) + "…"  # `a=1 b=2 …`: more values follow
    return Styled(short, text.style) if isinstance(text, Styled) else short


@dataclass(frozen=True)
class Fit:
    """How a table is made to fit a terminal's width: the columns that may be shortened, each to a least
    width, in the order they give way; then the columns left out, in that order, when shortening is not
    enough. A column named in neither keeps its width."""

    shrink: dict[str, int]
    drop: tuple[str, ...]
    keep_last_word: frozenset[str] = frozenset()  # shortened before their last word (a bar's `32/64`)


def shorten_before_last(text: str, width: int) -> str:
    """`text` in `width` columns, its last word kept whole: `Loading safet… 32/64`."""
    head, _, last = text.rpartition(" ")
    if len(text) <= width or not head or len(last) + 2 > width:
        return shorten(text, width)
    short = shorten(head, width - len(last) - 1).rstrip() + " " + last
    return Styled(short, text.style) if isinstance(text, Styled) else short


GAP = 2  # the columns' padding on a terminal: one space each side, none at the edges


def fitted(headers: list[str], cells: list[list[str]], width: int, fit: Fit) -> tuple[list[str], list[list[str]]]:
    """The columns and cells that fit in `width` (see Fit): values shortened where they may, never broken."""
    natural = {h: max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)}
    kept = list(headers)
    dropping = [h for h in fit.drop if h in headers]
    while True:
        widths = {h: natural[h] for h in kept}
        over = sum(widths.values()) + GAP * (len(kept) - 1) - width
        for h, least in fit.shrink.items():
            if over <= 0:
                break
            if h in widths:
                give = min(over, max(widths[h] - max(least, len(h)), 0))
                widths[h] -= give
                over -= give
        if over <= 0 or not dropping:
            break
        kept.remove(dropping.pop(0))
    index = [headers.index(h) for h in kept]
    cut = {h: shorten_before_last if h in fit.keep_last_word else shorten for h in kept}
    return kept, [[cut[headers[i]](row[i], widths[headers[i]]) for i in index] for row in cells]


def table(headers: list[str], rows: list[list[Any]], *, title: str | None = None, drop_empty: bool = False,
          fit: Fit | None = None) -> None:
    """A table on a terminal; off one (a pipe, a file) tab-separated lines, no value ever cut or wrapped.
    `drop_empty` leaves out the columns no row has a value in; `fit` makes it fit the terminal's width
    (values shortened, columns left out), else a long value wraps."""
    cells = [[cell(v) for v in row] for row in rows]
    if drop_empty and cells:
        keep = [i for i in range(len(headers)) if any(row[i] for row in cells)]
        headers, cells = [headers[i] for i in keep], [[row[i] for i in keep] for row in cells]
    if not out.is_terminal:
        if title:
            sys.stdout.write(title + "\n")
        for line in [headers, *cells]:
            # one record per line: a tab or newline inside a value would split it
            sys.stdout.write("\t".join(v.replace("\t", " ").replace("\n", "; ") for v in line) + "\n")
        sys.stdout.flush()
        return
    from rich.table import Table
    from rich.text import Text

    if fit is not None:
        headers, cells = fitted(headers, cells, out.width, fit)
    t = Table(*headers, box=None, title=title, pad_edge=False)
    for column in t.columns:
        if fit is not None:
            column.no_wrap = True  # shortened to fit already: a word is never split over two lines
        else:
            column.overflow = "fold"  # a long name wraps, it is never cut to `sglang-eagle3-h…`
    for row in cells:
        # Text: a value such as "[bold]" is data, not markup
        t.add_row(*(Text(v, style=getattr(v, "style", None) or "") for v in row))
    out.print(t)


def shown_of(shown: int, total: int, noun: str) -> None:
    """Tell (on stderr, so stdout stays data) that a listing was limited."""
    if shown < total:
        err.print(f"showing {shown} of {total} {noun} (--limit N shows more)")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{secs:02d}s"


def summary_lines(doc: dict[str, Any]) -> list[str]:
    """The end of `orch run` / `orch watch`: how it went and what to do next."""
    rid, status = doc["id"], doc["status"]
    # every headline the run has (they come first), else the first few of its metrics
    many = max(6, sum(1 for k in doc["metrics"] if k in doc.get("headlines", ())))
    metrics = " ".join(f"{k}={v:g}" for k, v in list(doc["metrics"].items())[:many])
    where = f"{doc['host']}:{doc['outputs']['remote_dir']}" if doc["outputs"]["remote_dir"] else None
    if status in ("succeeded", "running"):
        lines = [f"run {rid} {status}" + (f" in {duration(doc['duration_s'])}" if status == "succeeded"
                                          else f" ({doc['phase']})")]
        if doc.get("url"):
            lines.append(f"  url: {doc['url']}" + ("" if doc["host"] == "local" else f" (on {doc['host']})"))
        if metrics:
            lines.append(f"  metrics: {metrics}")
        if where:
            lines.append(f"  run dir: {where}")
        if doc["outputs"]["manifest"]:
            lines.append(f"  outputs: {doc['outputs']['manifest']}")
    else:
        lines = [f"run {rid} {status}" + (f": {doc['cause']}" if doc["cause"] else "")]
        if doc.get("hint"):
            lines.append(f"  try: {doc['hint']}")
        lines += [f"  | {line}" for line in doc["log_lines"]]
    lines.append("  next: " + "   ".join(doc["next"]))
    return lines
