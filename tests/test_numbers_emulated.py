"""Receipts, repeats and verdicts on this machine's `local` host with the SGLang stand-ins (tests/fakes): the
emulators' numbers do not depend on the settings, so every headline of two benchmarks is within the noise;
the tests-only nvidia-smi shows the GPUs a receipt records, and a process on them at launch makes a run
invalid."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from orchtest import Orch
from sshd import free_port
from test_serve import BENCH, FAKES, no_server_left_behind, serve_sets

__all__ = ["no_server_left_behind"]  # the autouse fixture: no server outlives a failing test

HEADLINES = ("output_throughput", "median_ttft_ms", "median_itl_ms", "accept_len")


@pytest.fixture
def orch(tmp_path: Path) -> Iterator[Orch]:
    o = Orch(tmp_path / "ws")
    state = tmp_path / "gpu-state.json"
    state.write_text(json.dumps({"gpus": [{"index": i, "uuid": f"GPU-0000000{i}", "memory_total": 81559}
                                          for i in (0, 1)], "processes": []}))
    o.env.update(PATH=f"{FAKES}{os.pathsep}{os.environ['PATH']}", ORCH_FAKE_GPU_STATE=str(state))
    yield o


def test_two_benchmarks_of_the_same_receipt_are_within_the_noise(orch: Orch) -> None:
    port = free_port("127.0.0.1")
    res = orch("run", "serve-eagle3", "--until-ready", *serve_sets(port, "--serve-after", "600"), "--set", "cleanup=false")
    assert res.returncode == 0, res.stderr
    bench = ["run", "bench-serving", "--set", "server=1", "--set", f"launcher={BENCH}", "--set", "num_prompts=10",
             "--set", "repeats=5", "--set", "warmup=1", "--set", "poll_min=0.05", "--set", "poll_max=0.3"]
    assert orch(*bench).returncode == 0
    assert orch(*bench).returncode == 0
    orch("stop", "1", check=0)
    doc = orch.status(2)
    assert doc["metric_summaries"]["output_throughput"]["samples"] == 5 and doc["invalid"] is None
    receipt = doc["receipt"]
    assert receipt["server"]["run"] == 1 and receipt["server"]["receipt"]["engine"]["name"] == "sglang"
    assert [g["name"] for g in receipt["hardware"]["gpus"]] == ["NVIDIA H100 80GB HBM3"] * 2
    assert receipt["hardware"]["gpus"][0]["driver_version"] == "550.54.15"
    assert (receipt["repeats"], receipt["warmup"], receipt["dataset"]["name"]) == (5, 1, "default")
    shown = orch("status", "2").stdout
    assert "  receipt: sglang " in shown and "data set default, 10 prompts, seed 1, warm-up 1, repeats 5" in shown
    got = json.loads(orch("compare", "2", "3", "--json").stdout)
    assert got["differences"] == []
    assert {n: got["metrics"][n]["verdict"] for n in HEADLINES} == dict.fromkeys(HEADLINES, "within_noise")


def test_a_run_whose_gpus_were_busy_at_launch_is_invalid(orch: Orch, tmp_path: Path) -> None:
    squatter = subprocess.Popen(["sleep", "300"])
    try:
        state = json.loads(Path(orch.env["ORCH_FAKE_GPU_STATE"]).read_text())
        state["processes"] = [{"pid": squatter.pid, "gpu": 1, "used_memory": 2000}]
        Path(orch.env["ORCH_FAKE_GPU_STATE"]).write_text(json.dumps(state))
        res = orch("run", "command", "--set", "cmd=true", "--set", "cleanup=false", "--set", "gpus=[1]")
        assert res.returncode == 0, res.stderr
        assert orch.status(1)["invalid"] == f"its GPUs were not clean at launch: process {squatter.pid} on GPU 1"
        res = orch("run", "command", "--set", "cmd=true", "--set", "cleanup=false", "--set", "gpus=[0]")
        assert orch.status(2)["invalid"] is None  # another GPU's process is none of its business
    finally:
        squatter.kill()
        squatter.wait()


def test_a_receipt_masks_the_secrets_of_the_job_s_command_line(orch: Orch) -> None:
    """A token on the command line, a password in a URL and an env secret's value written out are masked in
    the receipt as in the environment; the job still gets every one of them."""
    hostile = "hf_live_0123456789"
    cmd = (f"echo --hf-token {hostile} --db=postgres://me:pw0rd@db/x --again $'{hostile}' "
           f"--key-of-env s3cr3t-value --tokenizer tok > seen.txt; echo '--max-tokens' 7 >> seen.txt")
    res = orch("run", "command", "--set", f"cmd={cmd}", "--set", 'env={WANDB_API_KEY="s3cr3t-value"}',
               "--set", "cleanup=false")
    assert res.returncode == 0, res.stderr
    doc = orch.status(1)
    seen = Path(doc["remote_dir"], "seen.txt").read_text()
    assert hostile in seen and "pw0rd" in seen and "s3cr3t-value" in seen  # the job got them
    receipt = json.dumps(doc["receipt"])
    for secret in (hostile, "pw0rd", "s3cr3t-value"):
        assert secret not in receipt, (secret, doc["receipt"]["argv"])
    argv = doc["receipt"]["argv"]
    assert "--hf-token *** --db=*** --again $'***' --key-of-env *** --tokenizer tok" in argv, argv
    assert "'--max-tokens' 7" in argv and doc["receipt"]["env"]["WANDB_API_KEY"] == "***"


def test_the_gpu_step_s_last_look_is_the_receipt_s(orch: Orch, tmp_path: Path) -> None:
    """nvidia-smi is asked for the receipt's GPU facts in the GPU step's last look (the GPUs free), and not
    again by the launch."""
    calls, shim = tmp_path / "smi-calls", tmp_path / "shim"
    shim.mkdir()
    (shim / "nvidia-smi").write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {FAKES}/nvidia-smi "$@"\n')
    (shim / "nvidia-smi").chmod(0o755)
    orch.env["PATH"] = f"{shim}{os.pathsep}{orch.env['PATH']}"
    res = orch("run", "command", "--set", "cmd=true", "--set", "gpus=[1]")
    assert res.returncode == 0, res.stderr
    asked = calls.read_text().splitlines()
    looks = [a for a in asked if a.startswith("--query-gpu")]
    # the GPU step looks before its cleanup and once the GPUs are free: that last look takes the facts too
    assert len(looks) == 2 and "driver_version" not in looks[0] and "driver_version" in looks[1], asked
    assert len([a for a in asked if a.startswith("--query-compute-apps")]) == 2, asked
    doc = orch.status(1)
    gpus = doc["receipt"]["hardware"]["gpus"]
    assert [g["name"] for g in gpus] == ["NVIDIA H100 80GB HBM3"] * 2 and gpus[0]["driver_version"] == "550.54.15"
    assert "memory.used" not in gpus[0] and "gpu_check" not in doc["receipt"] and doc["invalid"] is None


def test_a_benchmark_of_a_url_holds_the_receipt_of_the_server_serving_it(orch: Orch) -> None:
    port = free_port("127.0.0.1")
    res = orch("run", "serve-eagle3", "--until-ready", *serve_sets(port, "--serve-after", "600"), "--set", "cleanup=false")
    assert res.returncode == 0, res.stderr
    bench = ["run", "bench-serving", "--set", f"launcher={BENCH}", "--set", "num_prompts=4", "--set", "poll_min=0.05",
             "--set", "poll_max=0.3"]
    assert orch(*bench, "--set", f"url=http://127.0.0.1:{port}").returncode == 0
    assert orch(*bench, "--set", f"url=http://127.0.0.1:{free_port('127.0.0.1')}", check=None).returncode in (0, 1)
    orch("stop", "1", check=0)
    served = orch.status(2)["receipt"]["server"]
    assert served["run"] == 1 and served["ready_at_launch"] is True and served["receipt"]["engine"]["name"] == "sglang"
    assert "server" not in orch.status(3)["receipt"]  # no run of this workspace serves that port
