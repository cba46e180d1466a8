"""`extract-hidden-states` with backend speculators: both pipelines end to end over the real sshd fleet.

The speculators scripts are tests-only stand-ins (tests/fakes/speculators_emulator/scripts) that take the
real flags and print the real formats; the pipeline is chosen with `speculators_version`, or read from
the host's python.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from orchtest import FAST, Orch, processes_of
from safetensors.numpy import load_file
from sshd import free_port

from orchestrator.config.spec import load
from orchestrator.errors import OrchError, SpecError, UsageError
from playbooks.extract_hidden_states import (
    CliServer,
    ExtractSpec,
    cli_server_argv,
    generator_argv,
    new_pipeline_script,
    num_hidden_layers,
    old_argv,
    pipeline_of,
    prepare_data_argv,
    server_argv,
    target_layer_ids,
)

SCRIPTS = Path(__file__).parent / "fakes" / "speculators_emulator" / "scripts"
PROMPTS = Path(__file__).parents[1] / "playbooks" / "data" / "prompts.jsonl"
MODEL = "/models/Llama-3.1-8B-Instruct"


def spec_sets(**values: object) -> list[str]:
    base = {"backend": "speculators", "scripts_dir": str(SCRIPTS), "model": MODEL}
    args: list[str] = []
    for key, value in {**base, **values}.items():
        if isinstance(value, dict):
            args += [a for k, v in value.items() for a in ("--set", f"{key}.{k}={v}")]
        else:
            args += ["--set", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
    return args + FAST


def preprocessed(tmp_path: Path, n: int) -> Path:
    """A preprocessed-data dir of the stand-in's shape: token ids per sample."""
    d = tmp_path / "prepared"
    d.mkdir()
    d.joinpath("data.jsonl").write_text("".join(json.dumps({"input_ids": list(range(i + 3, 2 * i + 9))}) + "\n"
                                                for i in range(n)))
    return d


def test_old_pipeline_end_to_end(orch, tmp_path):
    res = orch("run", "extract-hidden-states", "--host", "test1", "--detach",
               *spec_sets(speculators_version="0.3.0", dataset=str(PROMPTS), layers=[2, 16, 29],
                          max_samples=6, batch_size=2, seq_length=24, tp=1,
                          env={"SPECULATORS_EMULATOR_HOLD": str(tmp_path / "go")}), timeout=180)
    assert res.returncode == 0, res.stderr
    # mid-run: the phase and the progress come from the `Generating hidden states` bar (3 batches of 2)
    mid = orch.wait_for(1, lambda d: orch("status", "--refresh", "1", check=0) and d["progress"]
                        and d["progress"]["label"] == "Generating hidden states")
    assert mid["phase"] == "running" and mid["progress"]["total"] == 3 and mid["progress"]["done"] == 1
    (tmp_path / "go").touch()
    assert orch("watch", "1", timeout=180).returncode == 0
    doc = orch.status(1)
    assert doc["status"] == "succeeded" and doc["exit_code"] == 0 and doc["phase"] == "finished"
    assert doc["progress"]["label"] == "Saving files" and doc["progress"]["done"] == doc["progress"]["total"] == 6
    events = [(e["kind"], e["message"]) for e in doc["events"]]
    assert ("prepare", "speculators 0.3.0: old pipeline") in events
    assert ("phase", "running") in events and ("phase", "finished") in events
    assert doc["metrics"]["samples"] == 6 and doc["metrics"]["files"] == 8 and doc["metrics"]["output_mb"] > 0
    out = Path(doc["remote_dir"]) / "hidden_states"
    assert sorted(p.name for p in out.glob("data_*.pt")) == [f"data_{i}.pt" for i in range(6)]
    lengths = json.loads((out / "sample_lengths.json").read_text())
    import torch  # here: every worker collects this file, one runs it

    for i in range(6):
        sample = torch.load(out / f"data_{i}.pt")
        seq = sample["input_ids"].shape[0]
        assert seq == lengths[str(i)] <= 24
        assert len(sample["hidden_states"]) == 3  # the requested layers, in order
        assert all(h.shape == (seq, 16) for h in sample["hidden_states"])
    assert json.loads((out / "data_config.json").read_text())["generation"]["layer_ids"] == [2, 16, 29]
    outputs = json.loads((orch.root / "runs" / "1" / "outputs.json").read_text())
    assert outputs["data_pt"] == 6 and outputs["hs_safetensors"] == 0
    log = (Path(doc["remote_dir"]) / "log").read_text()
    assert "Generating hidden states" in log and "Data generation complete!" in log


def test_new_pipeline_end_to_end(orch, tmp_path):
    port = free_port("127.0.0.1")
    data = preprocessed(tmp_path, 7)
    res = orch("run", "extract-hidden-states", "--host", "test1",
               *spec_sets(speculators_version="0.5.0", dataset=str(data), layers=[1, 3], max_samples=5,
                          batch_size=4, port=port, tp=1, seq_length=512, trust_remote_code=True), timeout=180)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "succeeded" and doc["exit_code"] == 0 and doc["phase"] == "finished"
    assert doc["progress"]["done"] == doc["progress"]["total"] == 5
    assert ("prepare", "speculators 0.5.0: new pipeline") in [(e["kind"], e["message"]) for e in doc["events"]]
    assert doc["metrics"]["samples"] == 5 and doc["metrics"]["files"] == 5
    log = (Path(doc["remote_dir"]) / "log").read_text()
    # the server came up first, then the generator asked it for every sample
    started = log.index(f"Starting vLLM server on http://127.0.0.1:{port}")
    assert log.index("Running command:") < started < log.index("EAGLE Offline Data Generation")
    assert log.index("Data generation complete!") < log.index("Shutting down FastAPI HTTP server.")
    assert '"eagle_aux_hidden_state_layer_ids": [1, 3, 32]' in log  # launch_vllm adds the last layer
    assert "--tensor-parallel-size 1 --max-model-len 512" in log
    assert "'max_model_len': 512, 'trust_remote_code': True}" in log  # it reached vLLM past the launcher
    out = Path(doc["remote_dir"]) / "hidden_states"
    rows = [json.loads(line) for line in (data / "data.jsonl").read_text().splitlines()]
    for i in range(5):
        t = load_file(out / f"hs_{i}.safetensors")
        assert t["token_ids"].tolist() == rows[i]["input_ids"]
        assert t["hidden_states"].shape == (3, len(rows[i]["input_ids"]), 16)
    assert not (out / "hs_5.safetensors").exists()
    assert processes_of(tmp_path, str(SCRIPTS)) == []  # server and generator both gone


def test_generator_crash_fails_the_run(orch, tmp_path):
    port = free_port("127.0.0.1")
    data = preprocessed(tmp_path, 8)
    res = orch("run", "extract-hidden-states", "--host", "test1",
               *spec_sets(speculators_version="0.6.0", dataset=str(data), batch_size=2, port=port,
                          env={"SPECULATORS_EMULATOR_SERVER_DIES_AFTER": "3"}), timeout=180)
    assert res.returncode == 1, res.stderr
    doc = orch.status(1)
    assert doc["status"] == "failed" and doc["phase"] == "failed"
    # `Data generation failed` marks it fatal; the chained traceback's root cause names it
    err = doc["error"]
    assert err["kind"] == "python_exception" and err["exception"] == "http.client.RemoteDisconnected"
    assert err["message"] == "Remote end closed connection without response"
    assert "http.client.RemoteDisconnected" in doc["reason"]
    log = (Path(doc["remote_dir"]) / "log").read_text()
    assert "- ERROR - Data generation failed" in log
    assert "RuntimeError: Aborting: 2 consecutive samples errored out." in log
    assert doc["metrics"]["samples"] == 3  # what was written before the server went bad
    assert processes_of(tmp_path, str(SCRIPTS)) == []


def test_installed_version_chooses_the_pipeline(orch, tmp_path):
    # The host's python sees an installed speculators 0.4.0.1 (its metadata): the old pipeline.
    site = tmp_path / "site"
    meta = site / "speculators-0.4.0.1.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: speculators\nVersion: 0.4.0.1\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    res = orch("run", "extract-hidden-states", "--host", "test1",
               *spec_sets(python=str(python), dataset=str(PROMPTS), max_samples=2), timeout=180)
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    assert ("prepare", "speculators 0.4.0.1: old pipeline") in [(e["kind"], e["message"]) for e in doc["events"]]
    assert doc["metrics"]["samples"] == 2
    # no speculators for this python: refused before launch, nothing started
    res = orch("run", "extract-hidden-states", "--host", "test1", *spec_sets(dataset=str(PROMPTS)), timeout=60)
    assert res.returncode == 1
    doc = orch.status(2)
    assert doc["status"] == "failed" and doc["pid"] is None
    assert "speculators is not installed for" in doc["reason"] and "speculators_version" in doc["reason"]


def test_scripts_dir_without_the_scripts(orch, tmp_path):
    empty = tmp_path / "scripts"
    empty.mkdir()
    res = orch("run", "extract-hidden-states", "--host", "test1",
               *spec_sets(scripts_dir=str(empty), speculators_version="0.5.0", dataset="/d"), timeout=60)
    assert res.returncode == 1
    doc = orch.status(1)
    assert doc["status"] == "failed" and doc["pid"] is None
    assert f"data_generation_offline.py, launch_vllm.py not found in {empty} on test1" in doc["reason"]


@pytest.mark.parametrize("sets, message", [
    (["backend=speculators", "model=/m", "dataset=/d", "speculators_version=0.8.0"],
     "backend speculators needs scripts_dir"),
    (["backend=speculators", "scripts_dir=/s"], "backend speculators needs model, dataset"),
    (["tp=8", "port=8100"], "tp, port: only for backend speculators"),
    (["backend=speculators", "model=/m", "dataset=/d", "scripts_dir=/s", "dtype=bfloat16"],
     "dtype: only for backend hf"),
    (["backend=speculators", "model=/m", "dataset=/d", "scripts_dir=/s", "speculators_version=latest"],
     "not a version: 'latest'"),
    (["layers=[3,3]"], "layers must be distinct"),
    (["backend=vllm"], "backend"),
])
def test_bad_specs(sets, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        load(ExtractSpec, None, sets)


def test_bad_spec_is_refused_before_anything(tmp_path):
    orch = Orch(tmp_path / "ws")
    res = orch("run", "extract-hidden-states", "--set", "backend=speculators", "--set", "model=/m")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "backend speculators needs dataset" in res.stderr
    assert orch.status() == []


def test_stored_specs_load_again():
    # `orch watch` rebuilds the spec from its stored dump, where every field is named
    for spec in (ExtractSpec(), ExtractSpec(backend="speculators", scripts_dir="/s", model="/m", dataset="/d")):
        assert ExtractSpec.model_validate(spec.model_dump(mode="json")) == spec


HOSTILE = ["; touch {m}", "$(touch {m})", "`touch {m}`", "' ; touch {m}; '", "x\ntouch {m}"]


def test_hostile_values_never_execute(orch, tmp_path):
    values = [v.format(m=tmp_path / f"pwned{i}") for i, v in enumerate(HOSTILE)]
    res = orch("run", "extract-hidden-states", "--host", "test1",
               *spec_sets(speculators_version="0.5.0", model=values[0], dataset=values[1],
                          output_dir=str(tmp_path / "o") + values[2], vllm_args=[values[3]],
                          port=free_port("127.0.0.1")), timeout=120)
    assert res.returncode == 1  # the odd dataset path does not exist on the host
    log = (orch.root / "runs" / "1" / "log.tail").read_text()
    assert "Data generation failed" in log and f"No such file or directory: '{values[1]}" in log
    res = orch("run", "extract-hidden-states", "--host", "test1",
               *spec_sets(scripts_dir=values[4], speculators_version="0.3.0", dataset="/d"), timeout=60)
    assert res.returncode == 1 and "not found in" in orch.status(2)["reason"]
    assert not any(tmp_path.glob("pwned*"))
    assert processes_of(tmp_path, str(SCRIPTS)) == []


def test_flag_mapping():
    s = ExtractSpec(backend="speculators", scripts_dir="/opt/speculators/scripts", model="/models/Kimi K2",
                    dataset="sharegpt", output_dir="/out", layers=[2, 30, 58], tp=8, batch_size=16,
                    seq_length=4096, max_samples=1000, port=8100, vllm_args=["--gpu-memory-utilization", "0.9"])
    assert old_argv(s, "python3", "/out") == [
        "python3", "/opt/speculators/scripts/data_generation_offline.py", "--target-model-path", "/models/Kimi K2",
        "--train-data-path", "sharegpt", "--output-dir", "/out", "--layer-ids", "2", "30", "58",
        "--tensor-parallel-size", "8", "--batch-size", "16", "--seq-length", "4096", "--max-samples", "1000"]
    assert server_argv(s, "python3") == [
        "python3", "/opt/speculators/scripts/launch_vllm.py", "/models/Kimi K2", "--target-layer-ids", "2", "30", "58",
        "--", "--host", "127.0.0.1", "--port", "8100", "--tensor-parallel-size", "8", "--max-model-len", "4096",
        "--gpu-memory-utilization", "0.9"]
    assert generator_argv(s, "python3", "/out") == [
        "python3", "/opt/speculators/scripts/data_generation_offline.py", "--model", "/models/Kimi K2",
        "--endpoint", "http://127.0.0.1:8100/v1", "--preprocessed-data", "sharegpt", "--output", "/out",
        "--max-samples", "1000", "--concurrency", "16"]
    # unset fields leave the scripts' own defaults alone
    bare = ExtractSpec(backend="speculators", scripts_dir="/s", model="/m", dataset="/d")
    assert old_argv(bare, "py", "/o") == ["py", "/s/data_generation_offline.py", "--target-model-path", "/m",
                                          "--train-data-path", "/d", "--output-dir", "/o"]
    assert server_argv(bare, "py") == ["py", "/s/launch_vllm.py", "/m", "--", "--host", "127.0.0.1", "--port", "8000"]
    # launch_vllm.py's own flags go before `--`; its store is the run's own dir, never the shared /tmp one
    own = ExtractSpec(backend="speculators", scripts_dir="/s", model="/m", dataset="/d", trust_remote_code=True,
                      include_last_layer=False, layers=[2])
    assert server_argv(own, "py", "/w/runs/7/vllm_hidden_states") == [
        "py", "/s/launch_vllm.py", "/m", "--hidden-states-path", "/w/runs/7/vllm_hidden_states", "--target-layer-ids",
        "2", "--no-include-last-layer", "--trust-remote-code", "--", "--host", "127.0.0.1", "--port", "8000",
        "--trust-remote-code"]
    assert [pipeline_of(v) for v in ("0.3.0", "0.4.0.1", "0.5.0", "0.8.2", "0.9.0", "1.0.0rc1")] == \
        ["old", "old", "new", "new", "cli", "cli"]


def test_speculators_0_9_commands():
    """0.9 has no scripts/: the server orch starts is the one its launcher would exec, and its CLI takes the
    generator's flags."""
    s = ExtractSpec(backend="speculators", model="/models/tiny", dataset="/data/chat.jsonl", layers=[1, 2],
                    tp=2, seq_length=512, port=8100, batch_size=4, max_samples=16, trust_remote_code=True,
                    vllm_args=["--enforce-eager"])
    layers = target_layer_ids(s, 4)
    assert layers == [1, 2, 4]  # the last layer, the verifier's own, for the trainer
    argv = cli_server_argv(s, "py", "/w/runs/3/vllm_hidden_states", layers, scale_out=True)
    assert argv[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "/models/tiny"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}}
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == {
        "kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/w/runs/3/vllm_hidden_states"}}
    assert argv[argv.index("--kv-transfer-config") + 2:] == [
        "--host", "127.0.0.1", "--port", "8100", "--trust-remote-code", "--tensor-parallel-size", "2",
        "--max-model-len", "512", "--enable-scale-out", "--enforce-eager"]
    assert "--enable-scale-out" not in cli_server_argv(s, "py", "/st", layers)
    assert prepare_data_argv(s, "py", "/w/runs/3/prepared") == [
        "py", "-m", "speculators", "prepare-data", "--model", "/models/tiny", "--data", "/data/chat.jsonl",
        "--output", "/w/runs/3/prepared", "--render-endpoint", "http://127.0.0.1:8100", "--seq-length", "512",
        "--max-samples", "16", "--trust-remote-code"]
    assert generator_argv(s, "py", "/out", cli=True, data="/w/runs/3/prepared") == [
        "py", "-m", "speculators", "generate-offline-data", "--model", "/models/tiny",
        "--endpoint", "http://127.0.0.1:8100/v1", "--preprocessed-data", "/w/runs/3/prepared", "--output", "/out",
        "--max-samples", "16", "--concurrency", "4"]
    # the launcher's default layers, and its last-layer switch
    bare = ExtractSpec(backend="speculators", model="/m", dataset="/d")
    assert target_layer_ids(bare, 32) == [2, 16, 29, 32]
    assert target_layer_ids(bare.model_copy(update={"include_last_layer": False}), 32) == [2, 16, 29]
    with pytest.raises(UsageError, match=r"layers \[1, 2, 4\]: the model has 3 layers"):
        target_layer_ids(s.model_copy(update={"layers": [1, 2, 4]}), 3)
    assert num_hidden_layers('{"text_config": {"num_hidden_layers": 40}, "num_hidden_layers": 2}', "c") == 40
    with pytest.raises(OrchError, match="c: no num_hidden_layers"):
        num_hidden_layers('{"hidden_size": 8}', "c")
    script = new_pipeline_script(s, "py", "/out", "/st", CliServer(layers, "/w/runs/3/prepared", scale_out=True))
    lines = script.splitlines()
    # the server first, then prepare-data (a failure ends the job), then the generator on what it wrote
    assert "--enable-scale-out" in lines[1] and lines[-2].startswith("py -m speculators prepare-data")
    assert lines[-2].endswith("|| exit 1") and lines[-1].startswith("py -m speculators generate-offline-data")
    preprocessed = new_pipeline_script(s, "py", "/out", "/st", CliServer(layers))
    assert "prepare-data" not in preprocessed and "--enable-scale-out" not in preprocessed
    assert "--preprocessed-data /data/chat.jsonl" in preprocessed.splitlines()[-1]


def test_a_non_empty_output_dir_is_refused_unless_cleared(orch, tmp_path):
    out = tmp_path / "shared-out"
    (out / "old").mkdir(parents=True)
    (out / "data_0.pt").write_bytes(b"an earlier run's shard")
    (out / "old" / "data_9.pt").write_bytes(b"x" * 4096)
    sets = spec_sets(speculators_version="0.3.0", dataset=str(PROMPTS), layers=[2, 16, 29], max_samples=2,
                     batch_size=2, seq_length=24, tp=1, output_dir=str(out))
    res = orch("run", "extract-hidden-states", "--host", "test1", *sets, timeout=120)
    assert res.returncode == 2, res.stderr
    (line,) = res.stderr.strip().splitlines()  # one clear line
    assert f"output_dir {out} is not empty (3 entries, " in line and line.endswith(
        "KiB); set clear_output = true to clear it first"), line
    assert (out / "data_0.pt").read_bytes() == b"an earlier run's shard"  # nothing touched
    refused = orch.status(1)
    assert refused["status"] == "failed" and refused["pid"] is None
    assert not any(e["kind"] in ("gpu", "patch") for e in refused["events"])  # refused before cleanup ran

    res = orch("run", "extract-hidden-states", "--host", "test1", *sets, "--set", "clear_output=true", timeout=180)
    assert res.returncode == 0, res.stderr
    doc = orch.status(2)
    assert doc["status"] == "succeeded" and doc["metrics"]["samples"] == 2
    cleared = [e["message"] for e in doc["events"] if e["kind"] == "prepare" and "cleared" in e["message"]]
    assert cleared and cleared[0].startswith(f"cleared output_dir {out}: 3 entries, ")
    assert not (out / "old").exists()
    assert sorted(p.name for p in out.glob("data_*.pt")) == ["data_0.pt", "data_1.pt"]
    assert (out / "data_0.pt").read_bytes() != b"an earlier run's shard"
