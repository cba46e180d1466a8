"""The EAGLE-3 loop on the real vLLM 0.32.0 CPU build, with its debug patch set: a server with a tiny EAGLE-3 draft,
run by orch with the set applied to the vLLM it runs, logs every stage's hidden states in the lines the SGLang set
prints; `orch status` shows them as its table; benchmarks record acceptance; the stop reverts the set byte for
byte."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from orchtest import Orch, processes_of
from sshd import free_port

pytest_plugins = ["vllm_env"]  # tiny_models
pytestmark = pytest.mark.vllm

DEBUG_SET = "vllm-eagle3-hidden-debug"
STAGES = [("target.capture", 1), ("target.capture", 2), ("target.capture", 3), ("target.final_hidden", None),
          ("draft.input_hidden", None), ("draft.fc_out", None), ("draft.input_embeds", None)]


def digests(site: Path, files: list[str]) -> dict[str, str]:
    return {f: hashlib.sha256((site / f).read_bytes()).hexdigest() for f in files}


def serve(orch: Orch, python: Path, models: dict[str, Path], port: int, tokens: int) -> None:
    """serve-vllm with the EAGLE-3 draft and debug = true, until ready."""
    res = orch("run", "serve-vllm", "--set", f"model={models['target']}", "--set", f"python={python}",
               "--set", f"port={port}", "--set", "kv_cache_bytes=134217728", "--set", "max_model_len=256",
               "--set", f'speculative_config={{method = "eagle3", model = "{models["eagle3_const"]}"}}',
               "--set", f"num_speculative_tokens={tokens}", "--set", "debug=true",
               "--set", 'env={HF_HUB_OFFLINE = "1", VLLM_NO_USAGE_STATS = "1", PYTHONDONTWRITEBYTECODE = "1"}',
               "--set", "poll_min=0.5", "--set", "poll_max=2", "--until-ready", timeout=600)
    assert res.returncode == 0, res.stderr


def test_the_eagle3_loop_on_vllm_with_the_debug_set(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """The daily loop on the real vLLM: a server with an EAGLE-3 draft and the debug set applied to the vLLM it
    runs, ready; its hidden states at every stage in `orch status`'s table; a benchmark records acceptance
    and throughput; stop (the set reverted byte for byte); again with another num_speculative_tokens;
    compare the two benchmarks."""
    from vllm_env import engine_site, patchable_engine, vllm_files  # the plugin's module, once pytest has it

    files = [f for f in vllm_files() if "kv_connector" not in f]
    python = patchable_engine(tmp_path / "engine")
    [site] = (tmp_path / "engine" / "lib").glob("python3*/site-packages")
    real = digests(engine_site(), files)
    assert digests(site, files) == real
    orch = Orch(tmp_path / "ws")
    port = free_port("127.0.0.1")

    serve(orch, python, tiny_models, port, tokens=2)  # run 1
    assert digests(site, files) != real  # the job's vLLM runs the patched files
    server = orch.status(1)
    assert server["progress"]["total"] == 4, server["progress"]  # the target's 4 shards, not the draft's 1/1
    assert server["metrics"]["load_weight_s"] < 60  # the target's load, not the draft's 0.00 s
    bench = ["run", "bench-serving", "--set", "num_prompts=8", "--set", "input_len=32", "--set", "output_len=16",
             "--set", "poll_min=0.5", "--set", "poll_max=2"]
    assert orch(*bench, "--set", "server=1", timeout=600).returncode == 0  # run 2
    deadline = time.monotonic() + 120
    while True:
        table = orch.status(1)["eagle3_debug"]
        if {(r["stage"], r["layer"]) for r in table} == set(STAGES) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    rows = {(r["stage"], r["layer"]): r for r in table}
    assert list(rows) == STAGES  # in the order the stages first ran
    hidden = 256
    assert {rows[s]["shape"].split(", ")[1] for s in STAGES if s[0] != "draft.input_hidden"} == {f"{hidden})"}
    assert rows[("draft.input_hidden", None)]["shape"].endswith(f", {3 * hidden})")  # three layers side by side
    assert all(r["dtype"] == "bfloat16" and r["absmean"] > 0 and r["calls"] >= 2 for r in table)

    orch("stop", "1", check=0)
    doc = orch.status(1)
    assert doc["status"] == "cancelled" and doc["error"] is None, doc
    patches = [e["message"] for e in doc["events"] if e["kind"] == "patch"]
    assert patches[0].startswith(f"{DEBUG_SET} on vllm 0.32.0+cpu for {python}: ")
    assert patches[1].startswith(f"{DEBUG_SET} reverted: ")
    assert digests(site, files) == real  # byte for byte

    serve(orch, python, tiny_models, port, tokens=3)  # run 3
    assert orch(*bench, "--set", "server=3", timeout=600).returncode == 0  # run 4
    orch("stop", "3", check=0)
    first, second = orch.status(2)["metrics"], orch.status(4)["metrics"]
    assert first["accept_rate"] > 0 and second["accept_rate"] > 0  # the draft proposes what the target says
    assert first["output_throughput"] > 0 and second["output_throughput"] > 0
    compared = json.loads(orch("compare", "--previous", "--json", check=0).stdout)
    assert compared["runs"] == [2, 4], compared  # the benchmark against the one before it
    changed = [d["key"] for d in compared["differences"]]  # the servers' receipts name the key that changed
    assert any(k.startswith("server.receipt.") and k.endswith("num_speculative_tokens") for k in changed), changed
    assert compared["metrics"]["accept_rate"]["values"] == [first["accept_rate"], second["accept_rate"]]
    assert digests(site, files) == real and digests(engine_site(), files) == real  # the engine env never changed
    assert processes_of(tmp_path, str(python)) == [] and processes_of(tmp_path, "VLLM::") == []
