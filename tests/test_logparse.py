"""Log understanding against realistic transcripts of every engine version orch watches."""

from __future__ import annotations

import json

import pytest

from orchestrator.logparse import PHASES, LogParser, Progress, inspect_file, parse_bar

ESC_WORKER = "\x1b[1;36m({name} pid={pid})\x1b[0;0m "


def tqdm_line(desc: str, total: int, rate: str = " 1.50it/s", layout: str = "default", steps: list[int] | None = None,
              newline_each: bool = False, prefix: str = "") -> str:
    """What tqdm writes for one bar: '\\r' + bar per update, '\\n' on close (or per update when the
    format itself ends in '\\n', as SGLang <= 0.5.5 and vLLM do)."""
    out = []
    for n in steps if steps is not None else range(total + 1):
        pct = n * 100 // total
        rem = "?" if n == 0 else f"00:{(total - n) % 60:02d}"
        r = "?it/s" if n == 0 else rate
        if layout == "sglang":
            bar = f"{desc}: {pct:3d}% Completed | {n}/{total} [00:{n % 60:02d}<{rem}, {r}]"
        else:
            cells = ("█" * (pct // 10)).ljust(10)
            bar = f"{desc}: {pct:3d}%|{cells}| {n}/{total} [00:{n % 60:02d}<{rem}, {r}]"
        out.append(prefix + "\r" + bar + ("\n" if newline_each else ""))
    return "".join(out) + ("" if newline_each else "\n")


def feed_lines(parser: LogParser, text: str) -> list[str]:
    """Feed a transcript line by line and return the phases it went through."""
    phases = [parser.phase]
    for piece in text.encode().splitlines(keepends=True):
        parser.feed(piece)
        if parser.phase != phases[-1]:
            phases.append(parser.phase)
    parser.finish()
    if parser.phase != phases[-1]:
        phases.append(parser.phase)
    return phases


# ---- SGLang --------------------------------------------------------------------------------------

SGLANG_0_5_23_EAGLE = (
    "[2026-01-10 10:00:01] server_args=ServerArgs(model_path='/models/DeepSeek-V3', tp_size=8, "
    "speculative_algorithm='EAGLE3', speculative_draft_model_path='/models/ds-eagle3')\n"
    "[2026-01-10 10:00:03] Ignore import error when loading sglang.srt.models.mllama4: "
    "No module named 'transformers.models.mllama4'\n"
    "[2026-01-10 10:00:05 TP0] Init torch distributed begin.\n"
    "[2026-01-10 10:00:09 TP0] Load weight begin. avail mem=138.52 GB\n"
    + tqdm_line("Loading safetensors checkpoint shards", 163, rate=" 1.51s/it", layout="sglang", steps=[0, 1, 80, 163])
    + "[2026-01-10 10:04:15 TP0] Load weight end. elapsed=245.31 s, type=DeepseekV3ForCausalLM, fp8, "
    "avail mem=62.10 GB, mem usage=76.42 GB.\n"
    "[2026-01-10 10:04:16 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 500000, K size: 10.00 GB, "
    "V size: 10.00 GB\n"
    "[2026-01-10 10:04:16 TP0] Memory pool end. avail mem=30.00 GB\n"
    "[2026-01-10 10:04:17 TP0] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=4, "
    "avail mem=29.50 GB\n"
    + "".join(f"\rCapturing batches (bs={bs} avail_mem=29.{bs:02d} GB): {i * 25:3d}%|{'█' * (i * 25 // 10):10s}| "
              f"{i}/4 [00:0{i}<00:0{4 - i},  1.05it/s]" for i, bs in enumerate([64, 32, 16, 8, 4]))
    + "\n[2026-01-10 10:04:22 TP0] Capture target decode CUDA graph end. bs=[1, 2, 4], elapsed=5.50 s, "
    "mem usage=1.20 GB, avail mem=28.30 GB.\n"
    "[2026-01-10 10:04:23 TP0] Load weight begin. avail mem=28.00 GB\n"
    + tqdm_line("Loading safetensors checkpoint shards", 1, layout="sglang")
    + "[2026-01-10 10:04:25 TP0] Load weight end. elapsed=1.20 s, type=LlamaForCausalLMEagle3, "
    "avail mem=27.00 GB, mem usage=1.00 GB.\n"
    "[2026-01-10 10:04:26 TP0] Capture draft decode CUDA graph begin. backend=full, avail mem=26.90 GB\n"
    "[2026-01-10 10:04:30 TP0] Capture draft decode CUDA graph end. bs=[1, 2, 4], elapsed=4.00 s, "
    "mem usage=0.50 GB, avail mem=26.40 GB.\n"
    "INFO:     Started server process [4242]\n"
    "INFO:     Application startup complete.\n"
    "INFO:     Uvicorn running on http://0.0.0.0:30000 (Press CTRL+C to quit)\n"
    "[2026-01-10 10:04:40 TP0] Prefill batch, #new-seq: 1, #new-token: 7, #cached-token: 0, token usage: 0.00, "
    "#running-req: 0, #queue-req: 0\n"
    "[2026-01-10 10:04:41] The server is fired up and ready to roll!\n"
    "[2026-01-10 10:05:00 TP0] Decode batch, #running-req: 8, #token: 4096, token usage: 0.01, "
    "accept len: 2.85, accept rate: 0.62, cuda graph: True, gen throughput (token/s): 412.37, #queue-req: 0\n"
    "[2026-01-10 10:05:10 TP0] Decode batch [1240], #running-req: 8, #token: 4200, token usage: 0.01, "
    "accept len: 3.10, accept rate: 0.70, cuda graph: True, gen throughput (token/s): 455.10, #queue-req: 0\n"
)

SGLANG_0_5_5 = (
    "[2025-11-02 09:00:00] server_args=ServerArgs(model_path='/models/Llama-3.1-8B', tp_size=1)\n"
    "[2025-11-02 09:00:05] Load weight begin. avail mem=78.00 GB\n"
    + tqdm_line("Loading safetensors checkpoint shards", 4, layout="sglang", newline_each=True)
    + "[2025-11-02 09:00:15] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=63.00 GB, "
    "mem usage=15.00 GB.\n"
    "[2025-11-02 09:00:16] Capture cuda graph begin. This can take up to several minutes. avail mem=20.00 GB\n"
    + tqdm_line("Capturing batches (bs=1 avail_mem=19.90 GB)", 3)
    + "[2025-11-02 09:00:30] Capture cuda graph end. Time elapsed: 14.00 s. mem usage=0.80 GB. avail mem=19.10 GB.\n"
    "[2025-11-02 09:00:35] The server is fired up and ready to roll!\n"
    "[2025-11-02 09:01:00] Decode batch, #running-req: 4, #token: 1000, token usage: 0.02, accept len: 1.90, "
    "accept rate: 0.45, cuda graph: True, gen throughput (token/s): 88.80, #queue-req: 0, \n"
)

SGLANG_0_4_10 = (
    "[2025-08-01 08:00:00] server_args=ServerArgs(model_path='/models/Llama-3.1-8B')\n"
    "[2025-08-01 08:00:05 TP0] Load weight begin. avail mem=78.00 GB\n"
    + tqdm_line("Loading safetensors checkpoint shards", 2, layout="sglang", newline_each=True)
    + "[2025-08-01 08:00:15 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16, "
    "avail mem=63.00 GB, mem usage=15.00 GB.\n"
    "[2025-08-01 08:00:16 TP0] KV Cache is allocated. #tokens: 400000, K size: 20.00 GB, V size: 20.00 GB\n"
    "[2025-08-01 08:00:17 TP0] Capture cuda graph begin. This can take up to several minutes. avail mem=20.00 GB\n"
    "[2025-08-01 08:00:30 TP0] Capture cuda graph end. Time elapsed: 13.00 s. mem usage=0.80 GB. avail mem=19.10 GB.\n"
    "[2025-08-01 08:00:35] The server is fired up and ready to roll!\n"
    "[2025-08-01 08:01:00 TP0] Decode batch. #running-req: 1, #token: 90, token usage: 0.00, accept len: 1.47, "
    "cuda graph: True, gen throughput (token/s): 94.02, #queue-req: 0, \n"
)


def test_sglang_0_5_23_eagle_goes_through_every_phase() -> None:
    p = LogParser()
    phases = feed_lines(p, SGLANG_0_5_23_EAGLE)
    # target load, target graphs, draft load, draft graphs, the server starting, fired up, decoding
    assert phases == ["starting", "loading", "capturing", "loading", "capturing", "loading", "ready", "running"]
    assert p.engine == "sglang"
    assert p.error is None  # 'Ignore import error' is harmless
    # 0.5.23's rate is drafted tokens accepted per token drafted (its line has no trailing comma)
    assert p.metrics == {"load_weight_s": 1.20, "accept_len": 3.10, "accept_rate": 0.70, "draft_accept_rate": 0.70,
                         "gen_throughput": 455.10}
    # the draft model's one-shard bar is the last one
    assert p.progress == Progress("Loading safetensors checkpoint shards", 1, 1, 100.0, 1, 0, 1.5)


def test_sglang_capture_bar_label_changes_every_update() -> None:
    p = LogParser()
    p.feed(SGLANG_0_5_23_EAGLE.split("Capture target decode CUDA graph end")[0].encode())
    assert p.phase == "capturing"
    assert p.progress == Progress("Capturing batches (bs=4 avail_mem=29.04 GB)", 4, 4, 100.0, 4, 0, 1.05)


def test_sglang_0_5_23_shard_bar_is_one_cr_separated_line() -> None:
    p = LogParser()
    p.feed(SGLANG_0_5_23_EAGLE.split("Load weight end")[0].encode())
    assert p.phase == "loading"
    assert p.progress == Progress("Loading safetensors checkpoint shards", 163, 163, 100.0, 163 % 60, 0.0,
                                  pytest.approx(1 / 1.51))


@pytest.mark.parametrize("log, accept_len, rate, throughput", [
    (SGLANG_0_5_5, 1.90, 0.45, 88.80),
    (SGLANG_0_4_10, 1.47, None, 94.02),
])
def test_sglang_older_versions(log: str, accept_len: float, rate: float | None, throughput: float) -> None:
    """0.5.5's rate is per draft-token slot (its line ends in ', '); 0.4.10 prints none."""
    p = LogParser()
    phases = feed_lines(p, log)
    # graphs captured, the server still starting until it is fired up
    assert phases == ["starting", "loading", "capturing", "loading", "ready", "running"]
    assert p.engine == "sglang"
    assert p.metrics.get("accept_len") == accept_len
    assert p.metrics.get("accept_rate") == rate
    assert p.metrics.get("accept_per_draft_slot") == rate and "draft_accept_rate" not in p.metrics
    assert p.metrics["gen_throughput"] == throughput
    # older 'Load weight end.' prints no elapsed time: the times of the begin and end lines give it
    assert p.metrics["load_weight_s"] == 10


def test_sglang_shard_bar_with_newline_per_update_is_progress() -> None:
    p = LogParser()
    p.feed(SGLANG_0_5_5.split("Load weight end")[0].encode())
    assert p.progress is not None
    assert (p.progress.done, p.progress.total, p.progress.percent) == (4, 4, 100.0)


def test_metrics_are_returned_with_their_lines() -> None:
    p = LogParser()
    samples = p.feed(SGLANG_0_5_23_EAGLE.encode())
    decode_lines = [i + 1 for i, line in enumerate(_logical_lines(SGLANG_0_5_23_EAGLE)) if "Decode batch" in line]
    got = [(m.name, m.value, m.line) for m in samples if m.name == "gen_throughput"]
    assert got == [("gen_throughput", 412.37, decode_lines[0]), ("gen_throughput", 455.10, decode_lines[1])]


def _logical_lines(text: str) -> list[str]:
    """Complete lines as the parser counts them: a blank piece before a lone '\\r' is not a line."""
    import re
    pieces = re.split(r"(\r\n|\r|\n)", text)
    return [seg for seg, brk in zip(pieces[::2], pieces[1::2]) if not (brk == "\r" and not seg.strip())]


BENCH = """\
Namespace(backend='sglang', host='127.0.0.1', port=30000, dataset_name='random')

============ Serving Benchmark Result ============
Backend:                                 sglang
Traffic request rate:                    inf
Successful requests:                     200
Benchmark duration (s):                  40.12
Total input tokens:                      204800
Total generated tokens:                  51200
Total generated tokens (retokenized):    51180
Request throughput (req/s):              4.98
Input token throughput (tok/s):          5104.69
Output token throughput (tok/s):         1276.17
Peak output token throughput (tok/s):    1800.00
Peak concurrent requests:                64
Total token throughput (tok/s):          6380.86
Concurrency:                             63.20
Accept length:                           2.91
----------------End-to-End Latency----------------
Mean E2E Latency (ms):                   12680.50
Median E2E Latency (ms):                 12400.10
---------------Time to First Token----------------
Mean TTFT (ms):                          820.33
Median TTFT (ms):                        640.25
P99 TTFT (ms):                           2100.00
-----------------Inter-Token Latency--------------
Mean ITL (ms):                           45.12
Median ITL (ms):                         38.50
P95 ITL (ms):                            90.00
==================================================
"""


def test_bench_serving_result_block() -> None:
    p = LogParser()
    p.feed(BENCH.encode())
    p.finish()
    # every numeric row, under the engine's result-JSON key or the label in snake case
    assert p.metrics == {
        "completed": 200, "duration_s": 40.12, "total_input_tokens": 204800, "total_output_tokens": 51200,
        "request_throughput": 4.98, "input_throughput": 5104.69, "output_throughput": 1276.17,
        "total_token_throughput": 6380.86, "concurrency": 63.2, "accept_len": 2.91,
        "mean_e2e_latency_ms": 12680.5, "median_e2e_latency_ms": 12400.1,
        "mean_ttft_ms": 820.33, "median_ttft_ms": 640.25, "p99_ttft_ms": 2100.0,
        "mean_itl_ms": 45.12, "median_itl_ms": 38.50, "p95_itl_ms": 90.0,
        "total_output_tokens_retokenized": 51180, "peak_output_throughput": 1800, "peak_concurrent_requests": 64,
    }
    assert p.error is None
    assert p.phase == "finished"


# ---- vLLM ----------------------------------------------------------------------------------------

def _w(name: str, pid: int, text: str) -> str:
    return ESC_WORKER.format(name=name, pid=pid) + text


VLLM_0_11 = (
    "INFO 10-01 12:00:00 [__init__.py:216] Automatically detected platform cuda.\n"
    + _w("APIServer", 100, "INFO 10-01 12:00:01 [api_server.py:1839] vLLM API server version 0.11.0\n")
    + _w("EngineCore_DP0", 200, "INFO 10-01 12:00:10 [gpu_model_runner.py:2602] Starting to load model "
         "/models/Llama-3.1-70B...\n")
    # vLLM 0.11 puts the coloured worker prefix in front of tqdm's '\r' on every update.
    + "".join(_w("Worker_TP0", 300, f"\rLoading safetensors checkpoint shards: {n * 25:3d}% Completed | {n}/4 "
                 f"[00:{n * 3:02d}<00:{(4 - n) * 3:02d},  3.00s/it]\n") for n in range(5))
    + _w("Worker_TP0", 300, "INFO 10-01 12:00:25 [default_loader.py:267] Loading weights took 12.34 seconds\n")
    + _w("Worker_TP0", 300, "INFO 10-01 12:00:26 [gpu_model_runner.py:2653] Model loading took 35.2 GiB "
         "and 13.500000 seconds\n")
    + _w("Worker_TP0", 300, "WARNING 10-01 12:00:27 [fused_moe.py:728] Using default MoE config. Performance "
                            "might be sub-optimal! Config file not found (error ignored)\n")
    + "".join(_w("Worker_TP0", 300, f"\rCapturing CUDA graphs (mixed prefill-decode, PIECEWISE): {n * 50:3d}%|"
                 f"{'█' * (n * 5):10s}| {n * 33}/67 [00:0{n}<00:0{2 - n}, 12.10it/s]") for n in range(3))
    + "\n"
    + _w("Worker_TP0", 300, "INFO 10-01 12:00:40 [gpu_model_runner.py:3480] Graph capturing finished in 6 secs, "
                            "took 0.50 GiB\n")
    + _w("APIServer", 100, "INFO 10-01 12:00:45 [api_server.py:1880] Starting vLLM API server 0 on "
                           "http://0.0.0.0:8000\n")
    + _w("APIServer", 100, "INFO:     Application startup complete.\n")
    + _w("APIServer", 100, "INFO 10-01 12:05:00 [loggers.py:127] Engine 000: Avg prompt throughput: 120.5 tokens/s, "
                           "Avg generation throughput: 880.2 tokens/s, Running: 8 reqs, Waiting: 0 reqs, "
                           "GPU KV cache usage: 2.1%, Prefix cache hit rate: 0.0%\n")
)

VLLM_0_33 = (
    "(APIServer pid=100) INFO 03-01 11:00:00 [api_server.py:1500] vLLM API server version 0.33.0\n"
    "(EngineCore pid=200) INFO 03-01 11:00:10 [gpu_model_runner.py:3000] Starting to load model "
    "/models/Llama-3.1-8B...\n"
    + tqdm_line("Loading safetensors checkpoint shards (eager)", 4, layout="sglang", newline_each=True)
    + "(EngineCore pid=200) INFO 03-01 11:00:30 [default_loader.py:300] Loading weights took 20.10 seconds\n"
    + tqdm_line("Capturing CUDA graphs (decode, FULL)", 5)
    + "(EngineCore pid=200) INFO 03-01 11:00:45 [gpu_model_runner.py:4000] Graph capturing finished in 5 secs, "
    "took 0.40 GiB\n"
    "(APIServer pid=100) INFO 03-01 11:00:50 [api_server.py:1600] Starting vLLM server on http://0.0.0.0:8000\n"
    "(APIServer pid=100) INFO:     Application startup complete.\n"
    "(APIServer pid=100) INFO 03-01 11:02:00 [loggers.py:200] Engine 000: Avg prompt throughput: 0.0 tokens/s, "
    "Avg generation throughput: 94.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.1%\n"
    "(APIServer pid=100) INFO 03-01 11:02:00 [metrics.py:100] SpecDecoding metrics: Mean acceptance length: 2.31, "
    "Accepted throughput: 50.00 tokens/s, Drafted throughput: 120.00 tokens/s, Accepted: 500 tokens, "
    "Drafted: 1200 tokens, Per-position acceptance rate: 0.700, 0.450, Avg Draft acceptance rate: 41.7%\n"
)


def test_vllm_0_11_ansi_worker_prefix_before_cr() -> None:
    p = LogParser()
    phases = feed_lines(p, VLLM_0_11)
    # graphs captured, the engine initialised, the API server still starting
    assert phases == ["starting", "loading", "capturing", "loading", "ready", "running"]
    assert p.engine == "vllm"
    assert p.error is None
    assert p.metrics == {"load_weight_s": 12.34, "gen_throughput": 880.2}
    assert p.progress is not None
    assert p.progress.label == "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE)"
    assert (p.progress.done, p.progress.total) == (66, 67)


def test_vllm_0_11_shard_bar_label_has_no_prefix_or_colour() -> None:
    p = LogParser()
    p.feed(VLLM_0_11.split("Loading weights took")[0].encode())
    assert p.progress == Progress("Loading safetensors checkpoint shards", 4, 4, 100.0, 12, 0, pytest.approx(1 / 3))


def test_vllm_0_33() -> None:
    p = LogParser()
    phases = feed_lines(p, VLLM_0_33)
    assert phases == ["starting", "loading", "capturing", "loading", "ready", "running"]
    assert p.engine == "vllm"
    assert p.metrics == {"load_weight_s": 20.10, "gen_throughput": 94.0, "accept_len": 2.31,
                         "accept_rate": pytest.approx(0.417), "draft_accept_rate": pytest.approx(0.417),
                         "accept_rate_pos_0": 0.7, "accept_rate_pos_1": 0.45}


# ---- speculators, transformers, plain tqdm --------------------------------------------------------

SPECULATORS_OLD = (
    "2025-10-01 12:00:00,000 - __main__ - INFO - Starting data generation with args: Namespace("
    "target_model_path='/models/Llama-3.1-8B', layer_ids=[2, 16, 29])\n"
    "2025-10-01 12:00:00,100 - speculators.data_generation.vllm_hidden_states_generator - INFO - "
    "Initializing vLLM with tensor_parallel_size=1\n"
    "INFO 10-01 12:00:05 [__init__.py:216] Automatically detected platform cuda.\n"
    + tqdm_line("Loading safetensors checkpoint shards", 4, layout="sglang", newline_each=True)
    + "INFO 10-01 12:00:20 [default_loader.py:267] Loading weights took 8.00 seconds\n"
    + tqdm_line("Generating hidden states", 50, rate=" 2.50it/s", steps=[0, 10, 25, 50])
    + tqdm_line("Saving files", 50, rate="40.00it/s", steps=[0, 50])
    + "2025-10-01 12:05:00,000 - __main__ - INFO - Data generation complete!\n"
)

SPECULATORS_NEW = (
    "2026-02-01 10:00:00,000 - speculators.cli.generate_offline_data - INFO - EAGLE Offline Data Generation\n"
    "2026-02-01 10:00:01,000 - speculators.cli.generate_offline_data - INFO - Processing 1000 samples\n"
    + "".join(f"\r{n // 10:3d}%|{'█' * (n // 100):10s}| {n}/1000 [00:{n // 100:02d}<00:{(1000 - n) // 100:02d}, "
              f"100.00it/s]" for n in (0, 250, 500, 1000)) + "\n"
    "2026-02-01 10:00:12,000 - speculators.cli.generate_offline_data - WARNING - Skipping sample 17 due to "
    "error: HTTP 500\n"
    "2026-02-01 10:00:13,000 - speculators.cli.generate_offline_data - INFO - Saved 999 new data points to /out\n"
    "2026-02-01 10:00:13,100 - speculators.cli.generate_offline_data - INFO - Data generation complete!\n"
)


def test_speculators_old_pipeline() -> None:
    p = LogParser()
    phases = feed_lines(p, SPECULATORS_OLD)
    assert phases == ["starting", "loading", "running", "finished"]
    assert p.engine == "speculators"
    assert p.metrics == {"load_weight_s": 8.0}
    assert p.progress is not None and p.progress.label == "Saving files" and p.progress.done == 50


def test_speculators_new_pipeline_bar_without_label() -> None:
    p = LogParser()
    phases = feed_lines(p, SPECULATORS_NEW)
    assert phases == ["starting", "running", "finished"]
    assert p.engine == "speculators"
    assert p.error is None  # a WARNING mentioning an error is not one
    assert p.progress == Progress("", 1000, 1000, 100.0, 10, 0, 100.0)


def test_speculators_mid_run_progress() -> None:
    p = LogParser()
    p.feed(SPECULATORS_OLD.split("\rGenerating hidden states:  50%")[0].encode())
    assert p.phase == "running"
    # the bar being drawn now is the unfinished last line
    assert p.progress == Progress("Generating hidden states", 10, 50, 20.0, 10, 40, 2.5)


TRANSFORMERS = (
    "/usr/lib/python3/site-packages/transformers/utils/hub.py:111: FutureWarning: Using `TRANSFORMERS_CACHE` is "
    "deprecated\n"
    + tqdm_line("Loading checkpoint shards", 4, rate=" 1.10it/s")
    + "Some weights of the model checkpoint were not used when initializing LlamaForCausalLM\n"
    + tqdm_line("Extracting hidden states", 200, rate="18.01s/it", steps=[0, 1, 2])
)


def test_transformers_job() -> None:
    p = LogParser()
    phases = feed_lines(p, TRANSFORMERS)
    assert phases == ["starting", "loading", "running"]
    assert p.engine == "transformers"
    assert p.progress is not None
    assert p.progress.rate_per_s == pytest.approx(1 / 18.01)
    assert p.progress.eta_s == 198 % 60  # as printed: '00:SS' built by tqdm_line


def test_plain_tqdm_is_generic_running() -> None:
    p = LogParser()
    p.feed(b"starting my job\n" + "\r".join(f"{n}it [00:0{n}, 99.50it/s]" for n in range(1, 5)).encode())
    assert p.engine is None
    assert p.phase == "running"
    assert p.progress == Progress("", 4, None, None, 4, None, 99.5)
    p.finish()
    assert p.engine == "generic"


# ---- progress bar parsing ------------------------------------------------------------------------

@pytest.mark.parametrize("line, expected", [
    ("Loading safetensors checkpoint shards:  50% Completed | 32/64 [01:02<01:02,  1.95s/it]",
     Progress("Loading safetensors checkpoint shards", 32, 64, 50.0, 62, 62, pytest.approx(1 / 1.95))),
    ("Generating hidden states:   0%|          | 0/1000 [00:00<?, ?it/s]",
     Progress("Generating hidden states", 0, 1000, 0.0, 0, None, None)),
    ("train:  12%|█▏        | 1.2k/10.0k [1:02:03<7:00:00, 1.20kit/s, loss=0.31, lr=1e-4]",
     Progress("train", 1200, 10000, 12.0, 3723, 25200, 1200.0)),
    ("  3%|▎         | 30/1000 [00:10<05:23,  3.00it/s]", Progress("", 30, 1000, 3.0, 10, 323, 3.0)),
    ("desc:  50% 5/10 [00:01<00:01,  5.00it/s]", Progress("desc", 5, 10, 50.0, 1, 1, 5.0)),
    ("copy: 100%|##########| 3.00M/3.00M [00:02<00:00, 1.50MB/s]", Progress("copy", 3e6, 3e6, 100.0, 2, 0, 1.5e6)),
    ("123it [00:01, 99.50it/s]", Progress("", 123, None, None, 1, None, 99.5)),
    ("batches: 7batch [10:00:01, 600.00s/batch]", Progress("batches", 7, None, None, 36001, None, 1 / 600)),
])
def test_parse_bar(line: str, expected: Progress) -> None:
    assert parse_bar(line) == expected


@pytest.mark.parametrize("line", [
    "[2025-01-01 12:00:00 TP0] Load weight begin. avail mem=78.00 GB",
    "GPU KV cache usage: 2.1%, Prefix cache hit rate: 0.0%",
    "progress 50% done",
    "",
])
def test_not_a_bar(line: str) -> None:
    assert parse_bar(line) is None


def test_progress_to_dict_is_json() -> None:
    p = parse_bar("x:  50%|█████     | 5/10 [00:05<00:05,  1.00it/s, loss=0.1]")
    assert p is not None
    assert json.loads(json.dumps(p.to_dict())) == {
        "label": "x", "done": 5, "total": 10, "percent": 50.0, "elapsed_s": 5, "eta_s": 5, "rate_per_s": 1.0}


def vllm_logged(prefix: str, lines: tuple[str, ...]) -> str:
    """One multi-line vLLM log record: its formatter breaks lines with '\\r\\n' and repeats the prefix."""
    return prefix + ("\r\n" + prefix).join(lines) + "\n"


# ---- crashes -------------------------------------------------------------------------------------

TB_FRAMES = (
    "Traceback (most recent call last):\n"
    '  File "/usr/lib/python3/dist-packages/sglang/srt/managers/scheduler.py", line 3034, in run_scheduler_process\n'
    "    scheduler = Scheduler(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank)\n"
    "                ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/usr/lib/python3/dist-packages/sglang/srt/model_executor/model_runner.py", line 500, in load_model\n'
    '    raise RuntimeError("Not enough memory. Please try to increase --mem-fraction-static.")\n'
)

SGLANG_LOADING = SGLANG_0_5_23_EAGLE.split("[2026-01-10 10:04:16 TP0] KV Cache")[0]

CRASHES = {
    "scheduler_cuda_oom": (
        SGLANG_LOADING
        + "[2026-01-10 10:04:17 TP3] Scheduler hit an exception: " + TB_FRAMES
        + "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of "
        "139.81 GiB of which 1.02 GiB is free.\n\n"
        "[2026-01-10 10:04:18] Received sigquit from a child process. It usually means the child failed.\n",
        "cuda_oom", "torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB.", True),
    "old_torch_cuda_oom": (
        SGLANG_0_4_10.split("[2025-08-01 08:00:35]")[0]
        + "[2025-08-01 08:00:31 TP0] Scheduler hit an exception: " + TB_FRAMES
        + "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB.\n"
        "[2025-08-01 08:00:31] Rank 0 scheduler is dead. Please check if there are relevant logs.\n"
        "[2025-08-01 08:00:31] Exit code: 1\n",
        "cuda_oom", "torch.cuda.OutOfMemoryError", "CUDA out of memory.", True),
    "not_enough_memory": (
        SGLANG_LOADING
        + "[2026-01-10 10:04:17 TP0] Scheduler hit an exception: " + TB_FRAMES
        + "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.\n",
        "cuda_oom", "RuntimeError", "Not enough memory.", True),
    "capture_oom": (
        SGLANG_0_5_5.split("[2025-11-02 09:00:30]")[0]
        + "[2025-11-02 09:00:31] Scheduler hit an exception: " + TB_FRAMES
        + "Exception: Capture cuda graph failed: CUDA error: out of memory\n"
        "Possible solutions:\n"
        "1. set --mem-fraction-static to a smaller value (e.g., 0.8 or 0.7)\n",
        "cuda_oom", "Exception", "Capture cuda graph failed: CUDA error: out of memory", True),
    "decode_oom": (
        SGLANG_0_5_5
        + "[2025-11-02 09:02:00] Decode out of memory. Try to lower your batch size.\n"
        "Try to allocate 4096 tokens.\n"
        "[2025-11-02 09:02:00] Scheduler hit an exception: " + TB_FRAMES
        + "RuntimeError: Decode out of memory. Try to lower your batch size.\n"
        "[2025-11-02 09:02:01] SIGQUIT received. signum=None, frame=None. It usually means one child failed.\n",
        "cuda_oom", "RuntimeError", "Decode out of memory.", True),
    "scheduler_died_sigkill": (
        SGLANG_LOADING
        + "Traceback (most recent call last):\n"
        '  File "<frozen runpy>", line 198, in _run_module_as_main\n'
        '  File "/usr/lib/python3/dist-packages/sglang/srt/entrypoints/engine.py", line 2020, in '
        "_wait_for_scheduler_ready\n"
        "    raise _scheduler_died_error(rank, proc)\n"
        "RuntimeError: Rank 2 scheduler died during initialization (exit code: -9). If exit code is -9 (SIGKILL), "
        "a common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to check.\n",
        "killed", "RuntimeError", "Rank 2 scheduler died during initialization (exit code: -9)", True),
    "scheduler_died_exit_1": (
        SGLANG_LOADING
        + "RuntimeError: Rank 2 scheduler died during initialization (exit code: 1). If exit code is -9 (SIGKILL), "
        "a common cause is the OS OOM killer. Run `dmesg -T | grep -i oom` to check.\n",
        "python_exception", "RuntimeError", "Rank 2 scheduler died during initialization (exit code: 1)", True),
    "old_scheduler_dead_sigkill": (
        SGLANG_0_4_10.split("[2025-08-01 08:00:16")[0]
        + "[2025-08-01 08:00:16] Rank 0 scheduler is dead. Please check if there are relevant logs.\n"
        "[2025-08-01 08:00:16] Exit code: -9\n",
        "killed", None, "Exit code: -9", True),
    "oom_killer_shell": (
        TRANSFORMERS + "/bin/bash: line 1:  4242 Killed                  python extract.py --model /m\n",
        "killed", None, "Killed", True),
    "warmup": (
        SGLANG_0_5_23_EAGLE.split("[2026-01-10 10:04:41]")[0]
        + "[2026-01-10 10:05:41] Initialization failed. warmup error: Traceback (most recent call last):\n"
        '  File "/usr/lib/python3/dist-packages/sglang/srt/entrypoints/http_server.py", line 2370, in '
        "_execute_server_warmup\n"
        "    res = requests.post(url + request_name, json=json_data, headers=headers, timeout=600)\n"
        "requests.exceptions.ReadTimeout: HTTPConnectionPool(host='127.0.0.1', port=30000): Read timed out.\n",
        "timeout", "requests.exceptions.ReadTimeout", "HTTPConnectionPool", True),
    "nccl_rank_prefixed": (
        "".join(f"[rank3]: {line}\n" for line in TB_FRAMES.splitlines())
        + "[rank3]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
        "NCCLUtils.hpp:268, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\n"
        "[rank3]: ncclUnhandledCudaError: Call to CUDA function failed.\n",
        "nccl", "torch.distributed.DistBackendError", "NCCL error in:", True),
    "nccl_watchdog": (
        ("[rank0]:[E101 10:00:00.000000000 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation "
         "timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600012 "
         "milliseconds before timing out.\n"),
        "nccl", None, "Watchdog caught collective operation timeout", True),
    "vllm_engine_core": (
        VLLM_0_33.split("(EngineCore pid=200) INFO 03-01 11:00:45")[0]
        + vllm_logged("(EngineCore pid=200) ERROR 03-01 11:00:46 [core.py:708] ", (
            "EngineCore failed to start.",
            "Traceback (most recent call last):",
            '  File "/usr/lib/python3/dist-packages/vllm/v1/engine/core.py", line 699, in run_engine_core',
            "    engine_core = EngineCoreProc(*args, **kwargs)",
            ("ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
             "when initializing the engine."),
        ))
        + "Traceback (most recent call last):\n"
        '  File "/usr/bin/vllm", line 10, in <module>\n'
        "    sys.exit(main())\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n",
        "cuda_oom", "ValueError", "No available memory for the cache blocks.", True),
    "vllm_type_error_in_engine": (
        VLLM_0_33.split("(EngineCore pid=200) INFO 03-01 11:00:45")[0]
        + vllm_logged("(EngineCore pid=200) ERROR 03-01 11:00:46 [core.py:708] ", (
            "EngineCore failed to start.",
            "Traceback (most recent call last):",
            '  File "/usr/lib/python3/dist-packages/vllm/model_executor/models/deepseek_v2.py", line 900, in forward',
            "    hidden_states, residual = layer(positions=positions, hidden_states=hidden_states)",
            "TypeError: DeepseekV2DecoderLayer.forward() missing 1 required positional argument: 'residual'",
        ))
        + "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n",
        "python_exception", "TypeError", "DeepseekV2DecoderLayer.forward() missing", True),
    "speculators_empty_message": (
        SPECULATORS_NEW.split("\r")[0]
        + "2026-02-01 10:00:02,000 - speculators.cli.generate_offline_data - ERROR - Data generation failed\n"
        "Traceback (most recent call last):\n"
        '  File "/opt/speculators/src/speculators/cli/generate_offline_data.py", line 510, in main\n'
        "    run(args)\n"
        '  File "/opt/speculators/src/speculators/data_generation/custom_worker.py", line 88, in _patched_forward\n'
        "    hidden_states = self.get_input_embeddings(input_ids)\n"
        "TypeError\n",
        "python_exception", "TypeError", "", True),
    "speculators_abort": (
        SPECULATORS_NEW.split("\r")[0]
        + "2026-02-01 10:00:02,000 - speculators.cli.generate_offline_data - ERROR - Data generation failed\n"
        "Traceback (most recent call last):\n"
        '  File "/opt/speculators/src/speculators/cli/generate_offline_data.py", line 185, in _worker\n'
        "    raise RuntimeError(\n"
        "RuntimeError: Aborting: 10 consecutive samples errored out. The vLLM server may be unreachable.\n",
        "python_exception", "RuntimeError", "Aborting: 10 consecutive samples errored out.", True),
    "bare_traceback": (
        TRANSFORMERS
        + "Traceback (most recent call last):\n"
        '  File "/opt/jobs/extract.py", line 40, in <module>\n'
        "    main()\n"
        "KeyError: 'model.layers.61.mlp'\n",
        # nothing caught it: its outermost frame is the script's module level
        "python_exception", "KeyError", "'model.layers.61.mlp'", True),
    "caught_traceback": (
        TRANSFORMERS
        + "Traceback (most recent call last):\n"
        '  File "/opt/jobs/extract.py", line 88, in extract_batch\n'
        "    states = model(**batch, output_hidden_states=True)\n"
        "KeyError: 'model.layers.61.mlp'\n",
        "python_exception", "KeyError", "'model.layers.61.mlp'", False),
}


@pytest.mark.parametrize("name", sorted(CRASHES))
def test_crash(name: str) -> None:
    log, kind, exception, message_start, fatal = CRASHES[name]
    p = LogParser()
    p.feed(log.encode())
    p.finish()
    err = p.error
    assert err is not None
    assert (err.kind, err.exception, err.fatal) == (kind, exception, fatal)
    assert message_start in err.message
    assert p.phase == "failed" if fatal else p.phase != "failed"
    # line points at the exception (or fatal) line, and the context shows it
    lines = _logical_lines(log)
    assert message_start in lines[err.line - 1] or (exception or "") in lines[err.line - 1]
    assert any(message_start in c for c in err.context)
    assert len(err.context) <= 30
    json.dumps(err.to_dict())


def test_error_context_has_lines_after() -> None:
    p = LogParser()
    p.feed(CRASHES["caught_traceback"][0].encode() + b"after one\nafter two\n")
    assert p.error is not None
    assert p.error.context[-2:] == ["after one", "after two"]
    assert p.error.context[-3].startswith("KeyError")


def test_tentative_traceback_cleared_by_progress() -> None:
    p = LogParser()
    log = CRASHES["caught_traceback"][0]
    p.feed(log.encode())
    assert p.error is not None and not p.error.fatal
    # the same bar redrawn at the same count (tqdm closing at exit) is no sign of health
    p.feed(b"\rExtracting hidden states:   1%|          | 2/200 [00:36<59:24, 18.01s/it]\n")
    assert p.error is not None
    p.feed(b"\rExtracting hidden states:   2%|          | 3/200 [00:54<59:06, 18.01s/it]\n")
    assert p.error is None
    assert p.phase == "running"


def test_tentative_traceback_cleared_by_decode_stats() -> None:
    p = LogParser()
    p.feed(SGLANG_0_5_5.encode() + b"Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad\n")
    assert p.error is not None and p.error.kind == "python_exception" and not p.error.fatal
    p.feed(SGLANG_0_5_5.splitlines(keepends=True)[-1].encode())
    assert p.error is None


def test_fatal_error_is_not_cleared() -> None:
    p = LogParser()
    p.feed(CRASHES["scheduler_cuda_oom"][0].encode())
    p.feed(b"[2026-01-10 10:05:00 TP0] Decode batch, #running-req: 1, #token: 1, token usage: 0.00, cuda graph: True, "
           b"gen throughput (token/s): 1.00, #queue-req: 0\n")
    assert p.error is not None and p.error.fatal and p.phase == "failed"


@pytest.mark.parametrize("line", [
    "[2026-01-10 10:00:03] Ignore import error when loading sglang.srt.models.x: CUDA out of memory",
    "(APIServer pid=1) INFO 10-01 12:00:00 [serving.py:1] Exception handler registered; error pages enabled\n",
    "(Worker_TP0 pid=3) WARNING 10-01 12:00:00 [x.py:1] NCCL error codes will be ignored: ncclSystemError\n",
    "2026-02-01 10:00:12,000 - speculators - WARNING - Skipping sample 17 due to error: CUDA out of memory\n",
    "INFO:     127.0.0.1:5555 - \"POST /generate HTTP/1.1\" 500 Internal Server Error\n",
    ("[2025-08-01 08:00:16] Available memory 3GB is less than required memory 4GB for warmup, reducing max_m to "
     "avoid out of memory\n"),
    "ValueError: this is printed by a program, not raised\n",
])
def test_harmless_lines(line: str) -> None:
    p = LogParser()
    p.feed(line.encode() + b"\n")
    p.finish()
    assert p.error is None
    assert p.phase == "starting"


def test_interleaved_rank_tracebacks_stay_apart() -> None:
    r3 = [f"[rank3]: {line}" for line in TB_FRAMES.splitlines()]
    r5 = [f"[rank5]: {line}" for line in TB_FRAMES.splitlines()]
    mixed = [x for pair in zip(r3, r5) for x in pair]
    p = LogParser()
    p.feed(("\n".join(mixed) + "\n[rank5]: AssertionError\n").encode())
    assert p.error is not None and (p.error.exception, p.error.message) == ("AssertionError", "")


def test_chained_traceback_keeps_root_cause() -> None:
    p = LogParser()
    p.feed(b"Traceback (most recent call last):\n  File \"a.py\", line 1, in f\nKeyError: 'w'\n\n"
           b"During handling of the above exception, another exception occurred:\n\n"
           b"Traceback (most recent call last):\n  File \"a.py\", line 3, in g\nRuntimeError: load failed\n")
    assert p.error is not None and (p.error.exception, p.error.message) == ("KeyError", "'w'")


# ---- byte-level robustness -----------------------------------------------------------------------

def test_cr_only_lines_and_crlf() -> None:
    p = LogParser()
    # an empty segment ended by a lone '\r' is the front of a redraw, not a line; '\r\n' is one break
    p.feed(b"one\r\ntwo\r\rthree\r\n\nfour\n")
    p.finish()
    assert p.lines == 5


def test_invalid_utf8_does_not_raise() -> None:
    p = LogParser()
    p.feed(b"\xff\xfe garbage \xc3\x28 \xe2\x82\n" + "Loading checkpoint shards:  50%|█████     | 2/4 "
           "[00:02<00:02,  1.00it/s]".encode()[:-3] + b"\xff]\n")
    p.feed(b"Traceback (most recent call last):\n  File \"\xff.py\"\nValueError: \xfe\xff bad\n")
    p.finish()
    assert p.error is not None and p.error.message == "\ufffd\ufffd bad"
    json.dumps(p.to_dict())


def test_multibyte_char_split_across_chunks() -> None:
    data = tqdm_line("Loading checkpoint shards", 4).encode()
    whole = LogParser()
    whole.feed(data)
    split = LogParser()
    for i in range(len(data)):
        split.feed(data[i:i + 1])
    assert split.to_dict() == whole.to_dict()
    assert whole.progress is not None and whole.progress.done == 4


def test_ready_pattern_for_any_engine() -> None:
    p = LogParser(engine="generic", ready_pattern=r"Serving on port \d+")
    p.feed(b"warming up\nServing on port 9000\n")
    assert p.phase == "ready"
    assert p.engine == "generic"


def test_explicit_engine_is_kept() -> None:
    p = LogParser(engine="vllm")
    p.feed(SGLANG_0_5_5.encode())
    assert p.engine == "vllm"


def test_phases_constant() -> None:
    assert PHASES == ("starting", "loading", "capturing", "ready", "running", "finished", "failed")


def test_inspect_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "server.log"
    path.write_bytes(CRASHES["scheduler_cuda_oom"][0].encode())
    got = inspect_file(path, chunk_size=97)
    assert got["engine"] == "sglang"
    assert got["phase"] == "failed"
    assert got["error"]["kind"] == "cuda_oom"
    assert got["error"]["exception"] == "torch.OutOfMemoryError"
    # the exception line, followed by a blank line and the sigquit line
    assert got["error"]["line"] == len(_logical_lines(CRASHES["scheduler_cuda_oom"][0])) - 2
    assert got["metrics"] == {"load_weight_s": 245.31}
    assert got["progress"]["label"] == "Loading safetensors checkpoint shards"
    json.dumps(got)
