"""Every registered playbook keeps the plugin contract: its Spec round-trips through JSON, its keys can be
listed with their defaults (`orch run PLAYBOOK --help`, the manual), and a dry run quotes hostile values
so that running the job script it would launch injects nothing."""

from __future__ import annotations

import json
import subprocess
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator import runflow
from orchestrator.config import specdoc
from orchestrator.config.hosts import local_host
from orchestrator.config.workspace import Workspace
from orchestrator.playbook import Playbook, RunSpec
from orchestrator.runflow import registry
from orchestrator.store import Store

# The least each built-in needs; a playbook from a package gets its own entry or is tested with defaults.
REQUIRED: dict[str, dict[str, Any]] = {
    "command": {"cmd": "true"},
    "serve-eagle3": {"model": "/m", "draft_model": "/d"},
    "bench-serving": {"url": "http://127.0.0.1:30000"},
    "serve-bench": {"model": "/m", "draft_model": "/d"},
    "train-draft": {"scripts_dir": "/s", "verifier": "/m", "hidden_states": "/h", "data_path": "/d"},
}
# A command line the user means as shell; the interpreter the test stubs; names the registry looks up
# (a hostile one is refused there, see test_patching).
NOT_DATA = {"cmd", "python", "patches"}


def hostile(marker: Path) -> str:
    touch = f"/usr/bin/touch {marker}"
    return f"a'b\"c $({touch}) `{touch}` ; {touch} # & | > x\n{touch}"


def string_fields(spec_cls: type[RunSpec]) -> list[tuple[str, bool]]:
    """(name, is a list) for each field that holds text."""
    out = []
    for name, field in spec_cls.model_fields.items():
        text = str(field.annotation)
        if name not in NOT_DATA and "str" in text and "dict" not in text and "Literal" not in text:
            out.append((name, typing.get_origin(field.annotation) is list or "list[" in text))
    return out


def hostile_spec(pb: Playbook[Any], marker: Path, python: Path) -> tuple[RunSpec, list[str]]:
    """The playbook's spec with every text field it accepts set to a hostile value; the fields taken."""
    values: dict[str, Any] = {**REQUIRED.get(pb.name, {}), "python": str(python), "cleanup": False,
                              "env": {"ORCH_TEST_VALUE": hostile(marker)}}
    taken = []
    for name, is_list in string_fields(pb.Spec):
        bad = hostile(marker)
        trial = {**values, name: [bad] if is_list else bad}
        try:
            pb.Spec.model_validate(trial)
        except ValidationError:
            continue  # refused up front: just as safe
        values, taken = trial, [*taken, name]
    return pb.Spec.model_validate(values), taken


@pytest.mark.parametrize("pb", registry.playbooks(), ids=lambda pb: pb.name)
def test_spec_round_trips_through_json(pb: Playbook[Any], tmp_path: Path) -> None:
    spec, _ = hostile_spec(pb, tmp_path / "marker", tmp_path / "python")
    assert pb.Spec.model_validate_json(spec.model_dump_json()) == spec
    assert pb.Spec.model_validate(spec.model_dump(mode="json")) == spec


@pytest.mark.parametrize("pb", registry.playbooks(), ids=lambda pb: pb.name)
def test_every_key_is_listed_with_a_default_a_person_can_read(pb: Playbook[Any]) -> None:
    for doc in specdoc.fields(pb.Spec):
        shown = doc.default_text  # a table's default (serve-bench's `bench`) as the TOML-like JSON it is given in
        assert shown in ("required", "unset") or json.loads(shown) == doc.default, doc.name


@pytest.mark.parametrize("pb", registry.playbooks(), ids=lambda pb: pb.name)
def test_dry_run_quotes_hostile_values(pb: Playbook[Any], tmp_path: Path) -> None:
    marker, python = tmp_path / "injected", tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    spec, taken = hostile_spec(pb, marker, python)
    assert taken or pb.name not in REQUIRED, "no text field took a hostile value: the test tests nothing"
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    try:
        script = runflow.dry_run(ws, store, pb, spec, [local_host(tmp_path)]).script
    finally:
        store.close()
    assert script is not None, f"{pb.name}: the dry run launched nothing"
    run_dir = tmp_path / "runs" / "1"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.sh").write_text(script)
    subprocess.run(["bash", "./job.sh"], cwd=run_dir, capture_output=True, timeout=30, check=False)
    assert not marker.exists(), f"{pb.name}: a hostile value ran as shell ({', '.join(taken)})"
