"""The EAGLE-3 debug patch set on the real vLLM 0.32.0 CPU build: a server with a tiny EAGLE-3 draft, run by orch
with the set applied to the vLLM it runs, logs every stage's hidden states in the lines the SGLang set prints;
`orch status` shows them as its table; the stop reverts the set byte for byte."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.request
from pathlib import Path

import pytest
from orchtest import Orch, processes_of
from sshd import free_port

pytest_plugins = ["vllm_env"]  # tiny_llama, tiny_eagle3
pytestmark = pytest.mark.vllm

DEBUG_SET = "vllm-eagle3-hidden-debug"
STAGES = [("target.capture", 1), ("target.capture", 2), ("target.capture", 3), ("target.final_hidden", None),
          ("draft.input_hidden", None), ("draft.fc_out", None), ("draft.input_embeds", None)]


def digests(site: Path, files: list[str]) -> dict[str, str]:
    return {f: hashlib.sha256((site / f).read_bytes()).hexdigest() for f in files}


def test_a_served_eagle3_draft_logs_each_stage_into_the_table_and_the_stop_reverts_the_set(
        tmp_path: Path, tiny_llama: Path, tiny_eagle3: Path) -> None:
    from vllm_env import engine_site, patchable_engine, vllm_files  # the plugin's module, once pytest has it

    files = [f for f in vllm_files() if "kv_connector" not in f]
    python = patchable_engine(tmp_path / "engine")
    [site] = (tmp_path / "engine" / "lib").glob("python3*/site-packages")
    real = digests(engine_site(), files)
    assert digests(site, files) == real
    port = free_port("127.0.0.1")
    speculative = json.dumps({"method": "eagle3", "model": str(tiny_eagle3), "num_speculative_tokens": 2})
    cmd = (f"{python} -m vllm.entrypoints.cli.main serve {tiny_llama} --speculative-config '{speculative}' "
           f"--enforce-eager --dtype bfloat16 --max-model-len 256 --host 127.0.0.1 --port {port}")
    orch = Orch(tmp_path / "ws")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    res = orch("run", "command", "--set", f"cmd={cmd}", "--set", "engine=vllm", "--set", f"python={python}",
               "--set", f'patches=["{DEBUG_SET}"]', "--set", "ready_pattern=Application startup complete",
               *[a for k, v in env.items() for a in ("--set", f"env.{k}={v}")],
               "--set", "poll_min=1", "--set", "poll_max=2", "--until-ready", timeout=600)
    assert res.returncode == 0, res.stderr
    assert digests(site, files) != real  # the job's vLLM runs the patched files
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": str(tiny_llama), "prompt": "Hello, my name is", "max_tokens": 8,
                         "temperature": 0}).encode())
    with urllib.request.urlopen(request, timeout=120) as answer:
        assert json.load(answer)["choices"][0]["finish_reason"] == "length"

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
    patches = [e["message"] for e in doc["events"] if e["kind"] == "patch"]
    assert patches[0].startswith(f"{DEBUG_SET} on vllm 0.32.0+cpu for {python}: ")
    assert patches[1].startswith(f"{DEBUG_SET} reverted: ")
    assert digests(site, files) == real  # byte for byte
    assert digests(engine_site(), files) == real  # and the engine env never changed
    assert processes_of(tmp_path, str(python)) == [] and processes_of(tmp_path, "VLLM::") == []
