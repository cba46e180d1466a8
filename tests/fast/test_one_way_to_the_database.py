"""SQL lives in orchestrator/store/ alone: every other module speaks to the database through the store's
methods and modules, in Python objects and rows."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrator"
STORE = PACKAGE / "store"
STATEMENT_METHODS = {"execute", "executescript", "executemany", "query"}  # sqlite3's, and sqlite-utils' query

def database_calls(source: str) -> list[str]:
    """`line: call` for each statement run or connection opened in this source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "sqlite3" and any(
                a.name == "connect" for a in node.names):
            found.append(f"{node.lineno}: from sqlite3 import connect")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        owner = node.func.value
        if name in STATEMENT_METHODS or (name == "connect" and isinstance(owner, ast.Name) and owner.id == "sqlite3"):
            found.append(f"{node.lineno}: {ast.unparse(node.func)}(...)")
    return found


def modules_outside_the_store() -> dict[str, list[str]]:
    return {str(path.relative_to(PACKAGE)): database_calls(path.read_text())
            for path in sorted(PACKAGE.rglob("*.py")) if STORE not in path.parents}


def test_the_detector_sees_each_way_in() -> None:
    source = """
import sqlite3
from sqlite3 import connect
conn = sqlite3.connect("x.db")
conn.execute("SELECT 1")
store.conn.executemany("INSERT INTO t VALUES (?)", [(1,)])
db.executescript("CREATE TABLE t (a)")
store.db.query("SELECT 1")
with store.tx() as c:
    c.execute("DELETE FROM runs")
"""
    assert [line.split(":")[0] for line in database_calls(source)] == ["3", "4", "5", "6", "7", "8", "10"]
    assert database_calls("store.get_run(1)\nrunflow.cancel(run, 'why')\nexecute = 1\n") == []


def test_no_module_outside_the_store_speaks_sql() -> None:
    found = modules_outside_the_store()
    assert found, "no module outside orchestrator/store/ was read"
    offenders = {module: calls for module, calls in found.items() if calls}
    assert offenders == {}, "SQL outside orchestrator/store/: give the store a method for it"
