"""speculators 0.9's hidden-state extraction through orch on the real vLLM 0.32.0 CPU build: orch applies the
connector patch set to the vLLM the job runs, starts the server itself, runs prepare-data (the dataset is
conversations) and generate-offline-data, and counts the hs_*.safetensors files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from orchtest import Orch, processes_of
from safetensors.torch import load_file
from sshd import free_port

pytest_plugins = ["vllm_env"]  # tiny_llama
pytestmark = pytest.mark.vllm

CONNECTOR_SET = "vllm-cpu-hidden-states-connector"
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
TALKS = [("Hello, who are you?", "I am a tiny model."), ("Count to five.", "One two three four five."),
         ("Name a color.", "Blue, like the sky."), ("What is 2+2?", "It is four.")]


def test_speculators_0_9_extracts_hidden_states_with_the_connector_patched_by_orch(
        tmp_path: Path, tiny_llama: Path) -> None:
    from vllm_env import engine_site, patchable_engine  # the plugin's module, imported once pytest has it

    real = hashlib.sha256((engine_site() / CONNECTOR).read_bytes()).hexdigest()
    python = patchable_engine(tmp_path / "engine")
    data = tmp_path / "talks.jsonl"
    data.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": q},
                                                         {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in TALKS))
    orch = Orch(tmp_path / "ws")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    res = orch("run", "extract-hidden-states", "--set", "backend=speculators", "--set", f"model={tiny_llama}",
               "--set", f"dataset={data}", "--set", f"python={python}", "--set", f'patches=["{CONNECTOR_SET}"]',
               "--set", "layers=[1, 2, 3]", "--set", "seq_length=256", "--set", "batch_size=2",
               "--set", f"port={free_port('127.0.0.1')}",
               "--set", 'vllm_args=["--enforce-eager", "--dtype", "bfloat16"]',
               *[a for k, v in env.items() for a in ("--set", f"env.{k}={v}")],
               "--set", "poll_min=1", "--set", "poll_max=2", timeout=600)
    doc = orch.status(1)
    log = (Path(doc["remote_dir"]) / "log").read_text()
    events = [(e["kind"], e["message"]) for e in doc["events"]]
    assert ("prepare", "speculators 0.9.0: its CLI (generate-offline-data), the vLLM server started by orch") \
        in events
    assert any(kind == "patch" and msg.startswith(f"{CONNECTOR_SET} on vllm 0.32.0 for {python}: ")
               for kind, msg in events), events
    # the server came up, prepare-data rendered the talks through it, the generator saved every sample
    assert log.index("Application startup complete") < log.index("Saving the dataset") \
        < log.index("Saved 4 new data points") < log.index("Data generation complete!")
    assert "--enable-scale-out" in (Path(doc["remote_dir"]) / "job.sh").read_text()
    out = Path(doc["remote_dir"]) / "hidden_states"
    for i in range(len(TALKS)):
        t = load_file(out / f"hs_{i}.safetensors")
        tokens = t["token_ids"].shape[0]
        assert tokens > 10 and tuple(t["hidden_states"].shape) == (tokens, 4, 256)  # layers 1, 2, 3 and the last
        assert str(t["hidden_states"].dtype) == "torch.bfloat16"
    assert doc["metrics"]["samples"] == len(TALKS) == doc["metrics"]["files"]
    # the job stopped its own server at its end: a success, whatever vLLM logged while it shut down
    assert res.returncode == 0 and doc["status"] == "succeeded" and doc["error"] is None, doc
    # the server and its engine processes (which rename themselves VLLM::...) are gone
    assert processes_of(tmp_path, str(python)) == [] and processes_of(tmp_path, "VLLM::") == []
    # the engine env itself never changed; the job's copy is patched until reverted
    assert hashlib.sha256((engine_site() / CONNECTOR).read_bytes()).hexdigest() == real
    orch("patch", "revert", CONNECTOR_SET, "--python", str(python), check=0)

    # speculators 0.9's own trainer takes orch's flags (its config resolver would stop at a wrong one, exit 2),
    # then needs an accelerator for the draft: on a CPU host that is what the run names
    orch("run", "train-draft", "--set", f"verifier={tiny_llama}", "--set", f"hidden_states={out}",
         "--set", f"data_path={Path(doc['remote_dir']) / 'prepared'}", "--set", "layers=[1, 2, 3]",
         "--set", "epochs=1", "--set", "total_seq_len=256", "--set", f"python={python}",
         "--set", "env.HF_HUB_OFFLINE=1", "--set", "poll_min=1", "--set", "poll_max=2", timeout=600)
    train = orch.status(2)
    assert ("prepare", "speculators 0.9.0: python -m speculators.train") in [
        (e["kind"], e["message"]) for e in train["events"]]
    job = (Path(train["remote_dir"]) / "job.sh").read_text()
    assert f"{python} -m speculators.train --verifier-name-or-path {tiny_llama} --data-path " in job
    assert train["status"] == "failed" and train["exit_code"] != 2, train
    assert train["error"]["message"] == "Cannot access accelerator device when none is available.", train
