"""`orch inspect-log`: the real CLI on log files written by the engine stand-ins or in the engines' formats."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from orchtest import Orch

EMULATOR = Path(__file__).parent / "fakes" / "sglang_emulator.py"


@pytest.fixture
def orch_hosts() -> str:
    return ""  # the built-in `local` host only


def logical_lines(text: str) -> list[str]:
    """Lines as the parser numbers them: split on \\r and \\n; what stands before a \\r only counts if not blank."""
    lines = []
    for piece, sep in re.findall(r"([^\r\n]*)(\r\n|\r|\n|$)", text):
        if sep == "" and piece == "":
            continue
        if sep == "\r" and not piece.strip():
            continue
        lines.append(piece)
    return lines


def sglang_crash(path: Path) -> str:
    """A real transcript of the SGLang stand-in: a CUDA OOM in the scheduler while loading shard 5 of 8."""
    with open(path, "wb") as f:
        proc = subprocess.run([sys.executable, str(EMULATOR), "--shards", "8", "--shard-time", "0",
                               "--fail-at-shard", "5", "--crash", "cuda_oom"], check=False, stdout=f,
                              stderr=subprocess.STDOUT)
    assert proc.returncode == 137
    return path.read_bytes().decode()


def test_sglang_crash_transcript(orch: Orch, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    text = sglang_crash(log)
    got = json.loads(orch("inspect-log", str(log), "--json", check=0).stdout)
    assert got["engine"] == "sglang" and got["phase"] == "failed"
    err = got["error"]
    assert err["kind"] == "cuda_oom" and err["exception"] == "torch.OutOfMemoryError"
    assert err["message"].startswith("CUDA out of memory. Tried to allocate 1.75 GiB.")
    lines = logical_lines(text)
    assert lines[err["line"] - 1].startswith("torch.OutOfMemoryError: CUDA out of memory")
    p = got["progress"]
    assert (p["label"], p["done"], p["total"]) == ("Loading safetensors checkpoint shards", 4, 8)


def test_human_summary(orch: Orch, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    sglang_crash(log)
    res = orch("inspect-log", str(log), check=0)
    lines = res.stdout.splitlines()
    assert lines[0] == "engine: sglang  phase: failed"
    assert lines[1].startswith("progress: ") and "4/8" in lines[1]
    assert re.match(r"error \(line \d+\): cuda_oom: torch\.OutOfMemoryError CUDA out of memory\.", lines[2])
    # an OOM while loading the weights: the diagnosis, and where the advice comes from
    assert lines[3].startswith("hint: out of memory while loading the weights") and "(source: " in lines[3]
    assert len(lines) == 4  # no metrics line: the load never ended


VLLM_0_33 = (
    "(APIServer pid=100) INFO 03-01 11:00:00 [api_server.py:1500] vLLM API server version 0.33.0\n"
    "(EngineCore pid=200) INFO 03-01 11:00:10 [gpu_model_runner.py:3000] Starting to load model "
    "/models/Llama-3.1-8B...\n"
    + "".join(f"Loading safetensors checkpoint shards (eager): {25 * n:3d}% Completed | {n}/4 "
              f"[00:{5 * n:02d}<00:{5 * (4 - n):02d},  5.00s/it]\n" for n in range(5))
    + "(EngineCore pid=200) INFO 03-01 11:00:30 [default_loader.py:300] Loading weights took 20.10 seconds\n"
    "(APIServer pid=100) INFO 03-01 11:00:50 [api_server.py:1600] Starting vLLM server on http://0.0.0.0:8000\n"
    "(APIServer pid=100) INFO:     Application startup complete.\n"
    "(APIServer pid=100) INFO 03-01 11:02:00 [loggers.py:200] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
    "Avg generation throughput: 94.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.1%\n"
    "(APIServer pid=100) INFO 03-01 11:02:00 [metrics.py:100] SpecDecoding metrics: Mean acceptance length: 2.31, "
    "Accepted throughput: 50.00 tokens/s, Drafted throughput: 120.00 tokens/s, Accepted: 500 tokens, "
    "Drafted: 1200 tokens, Per-position acceptance rate: 0.700, 0.450, Avg Draft acceptance rate: 41.7%\n"
)


def test_vllm_log(orch: Orch, tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(VLLM_0_33)
    got = json.loads(orch("inspect-log", str(log), "--json", check=0).stdout)
    assert got["engine"] == "vllm" and got["phase"] == "running" and got["error"] is None
    assert got["metrics"] == {"load_weight_s": 20.1, "gen_throughput": 94.0, "accept_len": 2.31,
                              "accept_rate": pytest.approx(0.417), "draft_accept_rate": pytest.approx(0.417),
                              "accept_rate_pos_0": 0.7, "accept_rate_pos_1": 0.45}
    assert got["progress"]["label"] == "Loading safetensors checkpoint shards (eager)"
    assert got["progress"]["done"] == got["progress"]["total"] == 4
    human = orch("inspect-log", str(log), check=0).stdout
    assert "engine: vllm  phase: running" in human and "gen_throughput=94" in human and "error" not in human


def test_json_shape_exactly(orch: Orch, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    sglang_crash(log)
    got = json.loads(orch("inspect-log", str(log), "--json", check=0).stdout)
    assert list(got) == ["engine", "phase", "progress", "error", "metrics", "metric_summaries"]
    assert set(got["metric_summaries"]) == set(got["metrics"])
    assert set(got["error"]) == {"kind", "exception", "message", "line", "fatal", "chain", "hint"}
    assert got["error"]["fatal"] is True and got["error"]["chain"] == []  # the scheduler's own death line
    assert set(got["progress"]) == {"label", "done", "total", "percent", "elapsed_s", "eta_s", "rate_per_s"}
    assert isinstance(got["error"]["line"], int) and isinstance(got["metrics"], dict)
    empty = tmp_path / "empty.log"
    empty.write_bytes(b"")
    got = json.loads(orch("inspect-log", str(empty), "--json", check=0).stdout)
    assert got == {"engine": "generic", "phase": "starting", "progress": None, "error": None, "metrics": {},
                   "metric_summaries": {}}


def test_missing_file_is_bad_input(orch: Orch, tmp_path: Path) -> None:
    for path in (tmp_path / "nope.log", tmp_path):
        res = orch("inspect-log", str(path), "--json")
        assert res.returncode == 2 and res.stdout == ""
        assert res.stderr.strip().splitlines() == [f"orch: no such log file: {path}"]


def test_invalid_bytes_and_one_huge_cr_line(orch: Orch, tmp_path: Path) -> None:
    # 20k redraws on one physical line, broken UTF-8 in the middle, then a speculators crash.
    bars = "".join(f"\rGenerating hidden states: {n // 200:3d}%|{'#' * (n // 2000):10s}| {n}/20000 "
                   f"[00:{n // 1000:02d}<00:{(20000 - n) // 1000:02d}, 1000.00it/s]" for n in range(20000))
    data = (b"2025-10-01 12:00:00,000 - __main__ - INFO - EAGLE Offline Data Generation\n"
            + bars.encode() + b"\n\xff\xfe garbage \xc3\n"
            + b"2025-10-01 12:00:30,000 - __main__ - ERROR - Data generation failed\n")
    log = tmp_path / "gen.log"
    log.write_bytes(data)
    got = json.loads(orch("inspect-log", str(log), "--json", check=0).stdout)
    assert got["engine"] == "speculators" and got["phase"] == "failed"
    assert got["progress"]["done"] == 19999 and got["progress"]["label"] == "Generating hidden states"
    assert got["error"]["kind"] == "other" and "Data generation failed" in got["error"]["message"]
    assert got["error"]["line"] == 20003


def test_inspect_file_collects_the_samples_of_its_one_read() -> None:
    """What inspect-log's summaries need comes from the same read as the reading itself."""
    from orchestrator.logparse import LogParser, inspect_file

    log = Path(__file__).parent / "logs" / "megatron_iteration_lines.log"
    samples: list[tuple[str, float]] = []
    got = inspect_file(log, chunk_size=97, samples=samples)
    p = LogParser()
    want = [(m.name, m.value) for m in p.feed(log.read_bytes()) + p.finish()]
    assert samples == want and len({n for n, _ in samples}) > 3
    assert {n: v for n, v in samples} == got["metrics"]  # the last sample of each is the metric
