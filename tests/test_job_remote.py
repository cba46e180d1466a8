"""A playbook's looks at its host (JobContext.remote): answered by the host's agent, with no shell in
between; recorded and answered as an empty host in a dry run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator import runflow
from orchestrator.config.hosts import Host, local_host
from orchestrator.config.workspace import Workspace
from orchestrator.errors import RemoteError
from orchestrator.host.transport import LocalTransport
from orchestrator.playbook import Entry
from orchestrator.runflow import registry
from orchestrator.runflow.context import RunRemote
from orchestrator.store import Store


@pytest.fixture
def remote(tmp_path: Path) -> RunRemote:
    host = Host(name="local", workdir=str(tmp_path / "work"), python=sys.executable)
    root = tmp_path / "work" / "runs" / "1"
    root.mkdir(parents=True)
    return RunRemote(LocalTransport(host), str(root))


def test_files_are_looked_at_relative_to_the_run_dir(remote: RunRemote, tmp_path: Path):
    root = Path(remote.root)
    (root / "out" / "3").mkdir(parents=True)
    (root / "out" / "manifest.json").write_text('{"samples": 2}')
    (root / "out" / "link").symlink_to(root / "out" / "manifest.json")
    assert remote.is_dir("out") and remote.is_dir(str(root / "out")) and not remote.is_file("out")
    assert remote.is_file("out/manifest.json") and remote.exists("out/link") and remote.is_file("out/link")
    assert not remote.exists("out/nothing")
    assert remote.list_dir("out") == [Entry("3", "dir", (root / "out" / "3").lstat().st_size),
                                      Entry("link", "link", (root / "out" / "link").lstat().st_size),
                                      Entry("manifest.json", "file", 14)]
    assert remote.list_dir("out/manifest.json") is None
    held = remote.usage("out")
    assert held is not None and held.entries == 3
    assert remote.usage("nothing") is None
    assert remote.read_text("out/manifest.json") == '{"samples": 2}'
    assert remote.read_text("out/manifest.json", limit=4) == '{"sa'
    assert remote.read_text("out/link") is None  # never read through a symlink
    assert remote.read_text("out") is None


def test_read_text_reads_past_the_agents_chunk(remote: RunRemote):
    big = Path(remote.root) / "big"
    big.write_bytes(b"z" * (3 << 20))
    assert len(remote.read_text("big", limit=(2 << 20) + 5) or "") == (2 << 20) + 5


def test_run_argv_passes_words_as_data(remote: RunRemote, tmp_path: Path):
    marker = tmp_path / "injected"
    res = remote.run_argv([sys.executable, "-c", "import sys; print(sys.argv[1])", f"$(touch {marker})"])
    assert res.ok and res.stdout == f"$(touch {marker})\n" and not marker.exists()
    failed = remote.run_argv([sys.executable, "-c", "import sys; sys.exit('no')"], check=False)
    assert (failed.exit_code, failed.stderr) == (1, "no\n")
    with pytest.raises(RemoteError):
        remote.run_argv([sys.executable, "-c", "raise SystemExit(2)"])


def test_a_recording_host_records_each_look_and_answers_as_an_empty_host(tmp_path: Path):
    recorder = runflow.RecordingTransport(local_host(tmp_path))
    dry = RunRemote(recorder, str(tmp_path))
    (tmp_path / "there").write_text("x")
    try:
        assert not dry.is_file("there") and dry.list_dir(".") is None and dry.usage(".") is None
        assert dry.read_text("there") is None
        assert dry.run_argv(["python3", "-c", "print(1)"]).stdout == ""
    finally:
        recorder.close()
    asked = [s for s in recorder.steps if s.kind == "agent"]
    assert [s.request["op"] for s in asked] == ["stat", "listdir", "usage", "stat", "exec"]
    assert asked[0].what == f"look at what is at {tmp_path}/there (answered: nothing there)"
    assert asked[-1].what == "run without a shell: python3 -c 'print(1)'"


def test_the_dry_run_of_a_playbook_lists_its_looks(tmp_path: Path):
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    pb = registry.playbook("train-draft")
    spec = pb.Spec.model_validate({"scripts_dir": "/s", "verifier": "/m", "hidden_states": "/h", "data_path": "/d",
                                   "cleanup": False})
    store = Store(ws.db_path)
    try:
        text = runflow.dry_run(ws, store, pb, spec, [local_host(tmp_path)]).text()
    finally:
        store.close()
    assert "on local, the agent: look at what is at /s/train.py (answered: nothing there)" in text
    assert "the agent: run without a shell: " in text and "--data-path /d" in text


def test_the_dry_run_of_speculators_0_9_runs_its_cli_with_no_scripts(tmp_path: Path):
    """No scripts_dir: speculators 0.9's CLI. The model's config.json is looked at for the layers (a dry run
    cannot read it: shown as such), the dataset for a prepared one (none there: prepare-data first)."""
    ws = Workspace(root=tmp_path, hosts_file=tmp_path / "hosts.toml")
    store = Store(ws.db_path)
    try:
        pb = registry.playbook("extract-hidden-states")
        spec = pb.Spec.model_validate({"backend": "speculators", "model": "/m", "dataset": "/d/talks.jsonl",
                                       "cleanup": False})
        text = runflow.dry_run(ws, store, pb, spec, [local_host(tmp_path)]).text()
        pb = registry.playbook("train-draft")
        spec = pb.Spec.model_validate({"verifier": "/m", "hidden_states": "/h", "data_path": "/d", "cleanup": False})
        train = runflow.dry_run(ws, store, pb, spec, [local_host(tmp_path)]).text()
    finally:
        store.close()
    assert "look at what is at /m/config.json" in text and "look at what is at /d/talks.jsonl/dataset_info.json" in text
    assert "-m vllm.entrypoints.cli.main serve /m --speculative-config" in text
    assert '"eagle_aux_hidden_state_layer_ids": "<from /m/config.json>"' in text and "--enable-scale-out" in text
    assert "-m speculators prepare-data --model /m --data /d/talks.jsonl" in text
    assert "-m speculators generate-offline-data --model /m" in text and "launch_vllm.py" not in text
    assert "-m speculators.train --verifier-name-or-path /m --data-path /d --hidden-states-path /h" in train
    assert "train.py" not in train
