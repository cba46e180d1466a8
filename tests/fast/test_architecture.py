"""The architecture as written down (the layers table of docs/architecture.md) is the one enforced (pyproject's import contracts),
and the contracts name every unit of orchestrator."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def contracts() -> dict[str, dict]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {c["name"]: c for c in doc["tool"]["importlinter"]["contracts"]}


def units_of(entry: str) -> list[str]:
    return [u.strip().removeprefix("orchestrator.") for u in entry.split("|")]


def layers() -> list[list[str]]:
    (main,) = [c for c in contracts().values() if c["type"] == "layers" and "containers" not in c]
    return [units_of(entry) for entry in main["layers"]]


def leaves() -> list[str]:
    (leaf,) = [c for c in contracts().values() if c["type"] == "independence"]
    return [m.removeprefix("orchestrator.") for m in leaf["modules"]]


def top_level_units() -> set[str]:
    pkg = ROOT / "orchestrator"
    files = {p.stem for p in pkg.glob("*.py")} - {"__init__", "__main__"}
    return files | {p.parent.name for p in pkg.glob("*/__init__.py")}


def documented_rows() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+|leaves) \| ([^|]+) \|", text, re.MULTILINE)
    return {layer: re.findall(r"`([a-z_]+)`", units) for layer, units in rows}


def test_eight_layers_at_most_and_every_unit_placed_once() -> None:
    placed = [u for layer in layers() for u in layer] + leaves()
    assert len(layers()) <= 8
    assert sorted(placed) == sorted(top_level_units())


def test_the_documented_table_is_the_contract() -> None:
    rows = documented_rows()
    assert rows == {**{str(i): layer for i, layer in enumerate(layers(), 1)}, "leaves": leaves()}


def test_leaves_are_forbidden_every_other_unit() -> None:
    (rule,) = [c for c in contracts().values() if c["type"] == "forbidden"
               and c["source_modules"] == [f"orchestrator.{u}" for u in leaves()]]
    assert sorted(units_of("|".join(rule["forbidden_modules"]))) == sorted(top_level_units() - set(leaves()))


def test_playbooks_may_import_the_plugin_interface_only() -> None:
    (rule,) = [c for c in contracts().values() if c.get("source_modules") == ["playbooks"]]
    forbidden = set(units_of("|".join(rule["forbidden_modules"])))
    assert forbidden == top_level_units() - {"playbook", "run_tables"}
