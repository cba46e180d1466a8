"""Numbers one can trust, on the real vLLM (its CPU build) under orch: a benchmark repeated against one server
measures this machine's spread; two benchmarks of the same receipt are within the noise; a benchmark whose
requests fail is invalid; a patch set applied by orch that slows the engine's decode path is `worse` and
named in the differences. Each benchmark's receipt holds its server's."""

from __future__ import annotations

import difflib
import json
import time
from pathlib import Path

import pytest
from orchtest import Orch, processes_of
from sshd import free_port

pytest_plugins = ["vllm_env"]  # tiny_models
pytestmark = pytest.mark.vllm

ENV = '{HF_HUB_OFFLINE = "1", VLLM_NO_USAGE_STATS = "1", TOKENIZERS_PARALLELISM = "false"}'
RUNNER = "vllm/v1/worker/gpu_model_runner.py"  # the CPU model runner's forward pass is this class's
SLEEP_S = 0.3  # per forward pass: each decode step waits this much more (beyond a loaded machine's spread)


def slow_set(root: Path, site: Path) -> Path:
    """A patch set (a folder: patch.toml and one diff) that sleeps in the model runner's forward pass."""
    old = (site / RUNNER).read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(old) if line.startswith("    def _model_forward("))
    ret = next(i for i in range(at, len(old)) if old[i].strip() == "return self.model(")
    new = [*old[:ret], f"        __import__('time').sleep({SLEEP_S})  # slower decode, on purpose\n", *old[ret:]]
    folder = root / "slow-decode"
    folder.mkdir()
    (folder / "patch.toml").write_text('description = "Sleep in every forward pass."\npackage = "vllm"\n'
                                       'versions = "==0.32.0"\nstrip = 1\nrevert_after = true\n')
    (folder / "slow.diff").write_text("".join(difflib.unified_diff(old, new, f"a/{RUNNER}", f"b/{RUNNER}")))
    return folder


def serve(orch: Orch, python: Path, model: str, *sets: str) -> int:
    res = orch("run", "serve-vllm", "--json", "--set", f"model={model}", "--set", f"port={free_port('127.0.0.1')}",
               "--set", f"python={python}", "--set", "kv_cache_bytes=134217728", "--set", "enforce_eager=true",
               "--set", "max_model_len=256", "--set", f"env={ENV}", "--set", "poll_min=0.2", "--set", "poll_max=1",
               *sets, "--until-ready", timeout=600)
    assert res.returncode == 0, res.stderr
    return int(json.loads(res.stdout)["id"])


def bench(orch: Orch, server: int, *sets: str, check: int | None = 0) -> int:
    res = orch("run", "bench-serving", "--json", "--set", f"server={server}", "--set", "num_prompts=8",
               "--set", "input_len=32", "--set", "output_len=16", "--set", "poll_min=0.2", "--set", "poll_max=1",
               *sets, timeout=600, check=check)
    return int(json.loads(res.stdout)["id"])


def stop_all(orch: Orch) -> None:
    for run in orch.status():
        if run["status"] in ("running", "launching", "preparing"):
            orch("stop", str(run["id"]), "--grace", "10")


def test_repeats_measure_the_spread_and_compare_judges_against_it(tmp_path: Path, tiny_models: dict[str, Path],
                                                                  request: pytest.FixtureRequest) -> None:
    from vllm_env import patchable_engine

    python = patchable_engine(tmp_path / "engine")
    [site] = (tmp_path / "engine" / "lib").glob("python3*/site-packages")
    slow = slow_set(tmp_path, site)
    orch = Orch(tmp_path / "ws")
    request.addfinalizer(lambda: stop_all(orch))  # a failing test leaves no server behind
    model = str(tiny_models["target"])
    timings = {}

    server = serve(orch, python, model)
    started = time.monotonic()
    first = bench(orch, server, "--set", "repeats=5", "--set", "warmup=1")
    timings["bench with 1 warm-up + 5 repeats"] = time.monotonic() - started
    started = time.monotonic()
    second = bench(orch, server, "--set", "repeats=5", "--set", "warmup=1")
    timings["again"] = time.monotonic() - started
    started = time.monotonic()
    # every request goes to a path the server does not serve (no ready check first, which would stop it early)
    broken = bench(orch, server, "--set",
                   'extra_args=["--endpoint", "/v1/nowhere/completions", "--ready-check-timeout-sec", "0"]', check=1)
    timings["one run"] = time.monotonic() - started
    orch("stop", str(server), check=0)
    print("TIMINGS", timings, flush=True)

    doc = orch.status(first)
    assert doc["status"] == "succeeded" and doc["invalid"] is None, doc["reason"]
    s = doc["metric_summaries"]["output_throughput"]
    assert s["samples"] == 5 and s["min"] < s["max"]  # five repeats, one sample each: the machine's own spread
    receipt = doc["receipt"]
    assert receipt["engine"]["name"] == "vllm" and receipt["engine"]["version"].startswith("0.32.0")
    assert receipt["repeats"] == 5 and receipt["warmup"] == 1 and receipt["dataset"]["seed"] == 0
    assert receipt["hardware"]["cpu"]["count"] >= 1 and receipt["hostname"]
    served = receipt["server"]
    assert served["run"] == server and served["ready_at_launch"] is True
    assert set(served["receipt"]["model"]["files"]) >= {"config.json", "tokenizer_config.json"}
    assert "--max-model-len" in served["receipt"]["server_argv"]

    bad = orch.status(broken)
    assert bad["status"] == "failed" and bad["invalid"].startswith("8 of 8 benchmark requests failed"), bad

    same = json.loads(orch("compare", str(first), str(second), "--json", check=0).stdout)
    assert same["differences"] == []
    assert same["metrics"]["output_throughput"]["verdict"] == "within_noise", same["metrics"]["output_throughput"]
    against_bad = json.loads(orch("compare", str(first), str(broken), "--json", check=0).stdout)
    assert {m["verdict"] for m in against_bad["metrics"].values()} == {"incomparable"}

    slowed = serve(orch, python, model, "--set", f"patches=[{json.dumps(str(slow))}]")
    third = bench(orch, slowed, "--set", "repeats=5", "--set", "warmup=1")
    orch("stop", str(slowed), check=0)
    got = json.loads(orch("compare", str(second), str(third), "--json", check=0).stdout)
    keys = [d["key"] for d in got["differences"]]
    assert f"server.receipt.patches.{slow}.name" in keys, keys
    assert got["metrics"]["output_throughput"]["verdict"] == "worse", got["metrics"]["output_throughput"]
    assert got["metrics"]["median_itl_ms"]["verdict"] == "worse"
    assert orch.status(slowed)["receipt"]["patches"][0]["reverted"] is True
    assert processes_of(tmp_path, str(python)) == []

    figures = {n: got["metrics"][n]["noise"] for n in ("output_throughput", "median_itl_ms")}
    figures["same receipt"] = {n: same["metrics"][n]["noise"] for n in ("output_throughput", "median_itl_ms")}
    print("FIGURES", json.dumps({"timings_s": timings, **figures}))
