"""Plugins' tables about runs: made only by the plugin's own migrations, filled by its line readers from a
run's log, shown as a section of `orch status ID` named after it; a package's plugin gets all of it through
an entry point, with nothing in orch's core naming it."""

from __future__ import annotations

import json
import sqlite3
import textwrap
from pathlib import Path

import pytest
from orchtest import FAST, Orch

from orchestrator.errors import UsageError
from orchestrator.playbook import RunTables
from orchestrator.store import Store, migrations, runtables
from orchestrator.store.shapes import run_document
from playbooks.eagle3_debug import Eagle3Debug

LINE = ("[2026-01-02 03:04:05 TP0] [orch-eagle3-debug] target.capture layer_input=30 call={call} part=1/1 "
        "shape=(7, 7168) dtype=torch.bfloat16 absmean=0.5 sample=[0.1]")


def objects(path: Path) -> dict[str, str]:
    """The database's tables and views, by name: their type."""
    with sqlite3.connect(path) as conn:
        return dict(conn.execute("SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view')"))


def migration_sets(path: Path) -> dict[str, list[str]]:
    with sqlite3.connect(path) as conn:
        found: dict[str, list[str]] = {}
        for migration_set, name in conn.execute("SELECT migration_set, name FROM _sqlite_migrations ORDER BY id"):
            found.setdefault(migration_set, []).append(name)
        return found


def test_a_plugins_table_is_made_only_by_its_own_migrations(tmp_path):
    store = Store(tmp_path / "orch.db")
    run_id = store.create_run("command", "local", {})
    assert "eagle3_debug" not in objects(store.path)  # orch's own schema has no plugin's table
    assert set(migration_sets(store.path)) == {migrations.MIGRATIONS.name}
    plugin = Eagle3Debug()
    # a run shown in full uses the plugin: its migrations run then, as a set of their own
    doc = run_document(store, store.get_run(run_id), tables=[plugin])
    assert doc["eagle3_debug"] == []
    assert objects(store.path)["eagle3_debug"] == "table" and objects(store.path)["eagle3_debug_stages"] == "view"
    assert migration_sets(store.path)["plugin:eagle3_debug"] == ["m001_eagle3_debug", "m002_stages_view"]
    assert migration_sets(store.path)[migrations.MIGRATIONS.name] == migrations.names()
    store.add_rows(run_id, [("eagle3_debug", {"stage": "s", "call": c, "part": 1, "parts": 1, "shape": "(1,)",
                                              "dtype": "float16", "absmean": 0.25, "line": c}) for c in (0, 1)],
                   5.0, [plugin])
    store.use(plugin)  # applied once: nothing is made again
    assert migration_sets(store.path)["plugin:eagle3_debug"] == ["m001_eagle3_debug", "m002_stages_view"]
    assert run_document(store, store.get_run(run_id), tables=[plugin])["eagle3_debug"] == [
        {"stage": "s", "layer": None, "part": "1/1", "shape": "(1,)", "dtype": "float16", "absmean": 0.25,
         "call": 1, "calls": 2}]
    assert "eagle3_debug" not in run_document(store, store.get_run(run_id), with_events=False, tables=[plugin])


def test_a_database_of_an_older_orch_keeps_its_debug_table_and_rows(tmp_path):
    """Before plugins had tables of their own, orch's migration m011 made `eagle3_debug`: the plugin's first
    migration takes that table as it is, with its rows, and adds to it."""
    path = tmp_path / "orch.db"
    store = Store(path)
    run_id = store.create_run("command", "local", {})
    # the table as orch's m011_eagle3_debug made it, with its record in orch's migration set
    store.db["eagle3_debug"].create(
        {"id": int, "run_id": int, "ts": float, "line": int, "stage": str, "layer": int, "call": int, "part": int,
         "parts": int, "shape": str, "dtype": str, "absmean": float}, pk="id", foreign_keys=[("run_id", "runs", "id")])
    store.db["eagle3_debug"].create_index(["run_id", "stage"])
    store.conn.execute("INSERT INTO _sqlite_migrations (migration_set, name, applied_at) VALUES ('orch', "
                       "'m011_eagle3_debug', '2026-01-01')")
    store.conn.execute("INSERT INTO eagle3_debug (run_id, ts, line, stage, layer, call, part, parts, shape, dtype,"
                       " absmean) VALUES (?, 1.0, 7, 'target.capture', 30, 0, 1, 1, '(7, 7168)', 'bfloat16', 0.5)",
                       (run_id,))
    store.close()
    store = Store(path)
    plugin = Eagle3Debug()
    assert run_document(store, store.get_run(run_id), tables=[plugin])["eagle3_debug"] == [
        {"stage": "target.capture", "layer": 30, "part": "1/1", "shape": "(7, 7168)", "dtype": "bfloat16",
         "absmean": 0.5, "call": 0, "calls": 1}]
    store.add_rows(run_id, [("eagle3_debug", {**plugin.readers[0].read(LINE.format(call=1)), "line": 8})], 2.0, [plugin])
    (row,) = run_document(store, store.get_run(run_id), tables=[plugin])["eagle3_debug"]
    assert (row["call"], row["calls"]) == (1, 2)


def test_the_fields_of_a_run_are_no_sections_name(tmp_path):
    store = Store(tmp_path / "orch.db")
    doc = run_document(store, store.get_run(store.create_run("command", "local", {})))
    assert set(doc) | {"url"} <= runtables.TAKEN


@pytest.mark.parametrize("name,said", [("events", "a field of `orch status ID --json`"), ("Bad-Name", "does not match")])
def test_a_plugin_that_the_database_or_the_json_cannot_take_is_refused(monkeypatch, name, said):
    class Clash(RunTables):
        pass

    Clash.name = name
    monkeypatch.setitem(globals(), "_clash", Clash)
    with pytest.raises(UsageError, match=said):
        runtables._load(name, "test_run_tables:_clash")


# a package's plugin ---------------------------------------------------------------------------------------
PLUGIN = '''
"""A package's plugin: its gauges' lines, the highest value of each per run."""
from orchestrator.playbook import LineReader, RunTables, Shown


def parse(text):
    name, _, value = text.partition("[acme-gauge] ")[2].partition("=")
    try:
        return {"gauge": name, "value": float(value)}
    except ValueError:
        return None


def m001_gauges(db):
    db["acme_gauges"].create({"id": int, "run_id": int, "ts": float, "line": int, "gauge": str, "value": float},
                             pk="id")
    db.create_view("acme_highest", "SELECT run_id, gauge, MAX(value) AS highest FROM acme_gauges GROUP BY run_id, gauge")


class Gauges(RunTables):
    name = "acme_gauges"
    migrations = (("m001_gauges", m001_gauges),)
    readers = (LineReader("acme_gauges", "[acme-gauge]", parse),)

    def section(self, db, run_id):
        rows = db.execute("SELECT gauge, highest FROM acme_highest WHERE run_id = ? ORDER BY gauge", [run_id])
        return {gauge: highest for gauge, highest in rows}

    def show(self, section):
        return Shown("acme gauges (highest)", ["gauge", "highest"], [[g, v] for g, v in section.items()]) if section else None
'''


def with_package_plugin(orch: Orch, site: Path, module: str, entry: str) -> None:
    """An installed package (real dist-info metadata that importlib.metadata reads from the path) whose
    `orch.run_tables` entry point names its plugin."""
    info = site / "acme_gauges-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-gauges\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[orch.run_tables]\n{entry}\n")
    (site / "acme_gauges.py").write_text(module)
    orch.env["PYTHONPATH"] = str(site)


def test_a_packages_plugin_gets_its_table_and_its_section_in_status(tmp_path):
    orch = Orch(tmp_path / "ws")
    with_package_plugin(orch, tmp_path / "site", textwrap.dedent(PLUGIN), "acme_gauges = acme_gauges:Gauges")
    lines = "[acme-gauge] temp=41\\n[acme-gauge] temp=45\\nnot a gauge\\n[acme-gauge] fan=0.5\\n[acme-gauge] x=oops\\n"
    res = orch("run", "command", "--set", f"cmd=printf '{lines}'", *FAST)
    assert res.returncode == 0, res.stderr
    assert "acme_gauges" in objects(orch.db)  # made by the first rows it read, through its own migration
    assert migration_sets(orch.db)["plugin:acme_gauges"] == ["m001_gauges"]
    with sqlite3.connect(orch.db) as conn:
        rows = conn.execute("SELECT run_id, line, gauge, value FROM acme_gauges ORDER BY id").fetchall()
    assert rows == [(1, 1, "temp", 41.0), (1, 2, "temp", 45.0), (1, 4, "fan", 0.5)]
    doc = orch.status(1)
    assert doc["acme_gauges"] == {"fan": 0.5, "temp": 45}
    assert doc["eagle3_debug"] == []  # orch's own plugin: a section with nothing in it
    text = orch("status", "1", check=0)
    assert text.stderr == ""
    shown = [line.split() for line in text.stdout.splitlines()]
    assert ["acme", "gauges", "(highest):"] in shown and ["gauge", "highest"] in shown and ["temp", "45.0"] in shown
    assert "acme_gauges" not in json.loads(orch("status", "--json", check=0).stdout)[0]  # the list stays light


def test_a_plugin_that_fails_to_load_is_named_and_the_run_shown(tmp_path):
    orch = Orch(tmp_path / "ws")
    with_package_plugin(orch, tmp_path / "site", "raise RuntimeError('needs a module that is not installed')\n",
                        "acme_gauges = acme_gauges:Gauges")
    assert orch("run", "command", "--set", "cmd=echo '[acme-gauge] temp=41'", *FAST).returncode == 0
    res = orch("status", "1", "--json", check=0)
    assert res.stderr.startswith("orch: run tables 'acme_gauges'") and res.stderr.count("\n") == 1, res.stderr
    assert "RuntimeError: needs a module that is not installed" in res.stderr
    doc = json.loads(res.stdout)
    assert doc["status"] == "succeeded" and "acme_gauges" not in doc and doc["eagle3_debug"] == []


def test_the_light_interface_for_tables_offers_the_playbook_interfaces_own_names() -> None:
    """A tables-only package may import either module: the names are the same objects."""
    from orchestrator import playbook, run_tables

    for name in run_tables.__all__:
        assert getattr(run_tables, name) is getattr(playbook, name), name
