"""The `sglang-eagle3-hidden-debug` patch set's lines as a table of the run: read from any run's log (the
lines are the patch's, whoever launched the engine), kept in this plugin's own tables and shown by
`orch status ID` as its `eagle3_debug` section.

The patch logs (behind SGLang's own `[time TPn]` prefix):
    [orch-eagle3-debug] STAGE[ layer_input=N] call=C part=I/K shape=(A, B) dtype=torch.bfloat16 absmean=0.1234 sample=[...]
    [orch-eagle3-debug] STAGE call=C part=I/K None
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from orchestrator.run_tables import LineReader, RunTables, Shown

if TYPE_CHECKING:
    from sqlite_utils import Database

PREFIX = "[orch-eagle3-debug]"
TABLE = "eagle3_debug"
STAGES = "eagle3_debug_stages"

_LINE = re.compile(
    r"\[orch-eagle3-debug\] (?P<stage>\S+)(?: layer_input=(?P<layer>\d+))? call=(?P<call>\d+)"
    r" part=(?P<part>\d+)/(?P<parts>\d+)"
    r"(?: shape=(?P<shape>\([\d, ]*\)) dtype=(?P<dtype>\S+) absmean=(?P<absmean>[-+\w.]+)| (?P<none>None))"
)


def parse(text: str) -> dict[str, Any] | None:
    """The line's stage, layer, call, part, shape, dtype and mean |x| (None for a None tensor), or None."""
    m = _LINE.search(text)
    if m is None:
        return None
    absmean: float | None = None
    if m.group("absmean") is not None:
        try:
            absmean = float(m.group("absmean"))  # %.5g may print nan or inf: kept, they are the finding
        except ValueError:
            return None
    return {
        "stage": m.group("stage"),
        "layer": int(m.group("layer")) if m.group("layer") is not None else None,
        "call": int(m.group("call")),
        "part": int(m.group("part")),
        "parts": int(m.group("parts")),
        "shape": m.group("shape") if m.group("shape") is not None else "None",
        "dtype": m.group("dtype").removeprefix("torch.") if m.group("dtype") else None,
        "absmean": absmean,
    }


def m001_eagle3_debug(db: Database) -> None:
    # One row per tensor logged. orch made this same table in its own schema before plugins had tables of
    # their own: a database that has it keeps it, rows and all.
    db.table(TABLE).create(
        {"id": int, "run_id": int, "ts": float, "line": int, "stage": str, "layer": int, "call": int, "part": int,
         "parts": int, "shape": str, "dtype": str, "absmean": float},
        pk="id", foreign_keys=[("run_id", "runs", "id")], if_not_exists=True,
    )
    db.table(TABLE).create_index(["run_id", "stage"], if_not_exists=True)


def m002_stages_view(db: Database) -> None:
    # Per run, stage, layer and part: the latest call's row, how many calls were logged, and where the
    # first one was (the table's order: the order the stages first appeared).
    db.create_view(STAGES, f"""
        SELECT run_id, stage, layer, part, parts, call, shape, dtype, absmean, calls, first_id FROM (
            SELECT *, ROW_NUMBER() OVER (PARTITION BY run_id, stage, layer, part ORDER BY id DESC) AS newest,
                   COUNT(*) OVER (PARTITION BY run_id, stage, layer, part) AS calls,
                   MIN(id) OVER (PARTITION BY run_id, stage, layer, part) AS first_id
            FROM {TABLE})
        WHERE newest = 1""")


class Eagle3Debug(RunTables):
    name = "eagle3_debug"
    migrations = (("m001_eagle3_debug", m001_eagle3_debug), ("m002_stages_view", m002_stages_view))
    readers = (LineReader(TABLE, PREFIX, parse),)

    def section(self, db: Database, run_id: int) -> list[dict[str, Any]]:
        """Per stage, layer and part, the latest call's shape, dtype and mean |x|, with how many calls were
        logged; in the order the stages first appeared."""
        rows = db.execute(f"SELECT stage, layer, part, parts, shape, dtype, absmean, call, calls FROM {STAGES}"
                          " WHERE run_id = ? ORDER BY first_id", [run_id])
        return [{"stage": stage, "layer": layer, "part": f"{part}/{parts}", "shape": shape, "dtype": dtype,
                 "absmean": absmean, "call": call, "calls": calls}
                for stage, layer, part, parts, shape, dtype, absmean, call, calls in rows]

    def show(self, section: list[dict[str, Any]]) -> Shown | None:
        if not section:
            return None
        return Shown(f"hidden-state debug ({PREFIX} lines)",
                     ["stage", "layer", "part", "shape", "dtype", "mean |x|", "calls"],
                     [[r["stage"], r["layer"], r["part"], r["shape"], r["dtype"],
                       "-" if r["absmean"] is None else f"{r['absmean']:.5g}", r["calls"]] for r in section])
