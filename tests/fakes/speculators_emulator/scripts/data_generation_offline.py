#!/usr/bin/env python3
"""Tests-only stand-in for speculators' scripts/data_generation_offline.py, both generations of it.

With `--target-model-path` it is the old script (speculators <= 0.4.x: vLLM in-process): the old flags,
the `%(asctime)s - %(name)s - %(levelname)s - %(message)s` log with PipelineLogger's section lines,
vLLM's loading lines, tqdm bars `Generating hidden states` then `Saving files`, `Data generation
complete!`; writes OUT/data_{i}.pt (torch.save of input_ids, hidden_states list in layer order,
loss_mask), sample_lengths.json and data_config.json.

Otherwise it is the new client (speculators >= 0.5): the new flags; asks the vLLM server at --endpoint
(tests/fakes/speculators_emulator/scripts/launch_vllm.py) for each sample, moves the hidden-states file
the server wrote to OUT/hs_{i}.safetensors, a tqdm bar without a label, `Data generation failed` with
the traceback on any error.

Datasets: JSONL of {"text": ...}, {"prompt": ...} or {"input_ids": [...]}; a directory holds it as data.jsonl. A token
is a byte of the text. Test knobs (environment): SPECULATORS_EMULATOR_STEP_TIME seconds per sample;
SPECULATORS_EMULATOR_HOLD=PATH: the old script waits after its first batch until PATH exists.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

FORMAT = "%(asctime)s - %(name)s - %(levelname)s - %(message)s"
HIDDEN = 16
STEP = float(os.environ.get("SPECULATORS_EMULATOR_STEP_TIME", "0.01"))
HOLD = os.environ.get("SPECULATORS_EMULATOR_HOLD")


def hold(path: str, limit: float = 60) -> None:
    """Stay mid-run (after the first batch) until the test creates `path`."""
    deadline = time.time() + limit
    while not os.path.exists(path) and time.time() < deadline:
        time.sleep(0.02)


def load_samples(path: str, seq_length: int | None, max_samples: int | None) -> list[list[int]]:
    p = Path(path)
    if p.is_dir():
        p = p / "data.jsonl"
    samples = []
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        text = item.get("text") or item.get("prompt") or ""
        ids = item["input_ids"] if "input_ids" in item else list(text.encode())
        samples.append(ids[:seq_length] if seq_length else ids)
    return samples[:max_samples] if max_samples else samples


# ---- speculators <= 0.4.x ------------------------------------------------------------------------

def section(log: logging.Logger, title: str) -> None:
    line = "━" * (len(title) + 4)
    log.info("%s", line)
    log.info("%s", f"  {title}")
    log.info("%s", line)


def vllm_line(text: str, where: str = "default_loader.py:267") -> None:
    sys.stderr.write(f"INFO {time.strftime('%m-%d %H:%M:%S')} [{where}] {text}\n")
    sys.stderr.flush()


def old_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="Generate EAGLE training data offline")
    ap.add_argument("--target-model-path", required=True)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--train-data-path", required=True)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--token-freq-path", default="./token_freq.pt")
    ap.add_argument("--hf-cache-dir", default=None)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-idx", type=int, default=0)
    ap.add_argument("--num-preprocessing-workers", type=int, default=8)
    args = ap.parse_args(argv)

    import torch

    logging.basicConfig(level=logging.INFO, format=FORMAT)
    log = logging.getLogger("__main__")
    gen_log = logging.getLogger("speculators.data_generation.vllm_hidden_states_generator")
    section(log, "EAGLE Offline Data Generation")
    for key, value in (("Target Model", args.target_model_path), ("Dataset", args.train_data_path),
                       ("Output Dir", args.output_dir), ("Tensor Parallel", args.tensor_parallel_size),
                       ("Batch Size", args.batch_size)):
        log.info("  %s │ %s", key.ljust(15), value)
    samples = load_samples(args.train_data_path, args.seq_length, args.max_samples)
    log.info("  Loaded %d samples", len(samples))
    log.info("\n▸ Initializing vLLM hidden states generator")
    gen_log.info("  Initializing hidden states generator for %s", args.target_model_path)
    gen_log.info("  Tensor parallel size: %d", args.tensor_parallel_size)
    vllm_line("Automatically detected platform cuda.", "__init__.py:216")
    for n in range(5):
        sys.stderr.write(f"Loading safetensors checkpoint shards: {25 * n:3d}% Completed | {n}/4 "
                         f"[00:{n:02d}<00:{4 - n:02d},  1.00it/s]\n")
        sys.stderr.flush()
        time.sleep(STEP)
    vllm_line("Loading weights took 0.04 seconds")
    num_layers = 32
    gen_log.info("  Model has %d layers", num_layers)
    layers = args.layer_ids or [2, num_layers // 2, num_layers - 3]
    gen_log.info("  Using specified layers: %s" if args.layer_ids else "  Auto-selected layers: %s", layers)

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    gen = torch.Generator().manual_seed(args.seed)
    for start in tqdm(range(0, len(samples), args.batch_size), desc="Generating hidden states", mininterval=0):
        if start and HOLD:
            hold(HOLD)
        for ids in samples[start:start + args.batch_size]:
            time.sleep(STEP)
            seq = len(ids)
            results.append({
                "input_ids": torch.tensor(ids, dtype=torch.long),
                "hidden_states": [torch.randn(seq, HIDDEN, generator=gen) + layer for layer in layers],
                "loss_mask": torch.ones(seq, dtype=torch.long),
            })
    log.info("  Waiting for remaining file saves to complete...")
    lengths = {}
    for i, result in enumerate(tqdm(results, desc="Saving files", mininterval=0)):
        torch.save(result, out / f"data_{i}.pt")
        lengths[str(i)] = int(result["input_ids"].shape[0])
    (out / "sample_lengths.json").write_text(json.dumps(lengths))
    log.info("  Saved %d new data points to %s", len(results), out)
    log.info("\n▸ Saving configuration metadata")
    config = {"version": "2.0", "generation": {"model": args.target_model_path, "layer_ids": layers,
              "tensor_parallel_size": args.tensor_parallel_size, "max_model_len": args.max_model_len},
              "dataset": {"train_data_path": args.train_data_path, "seq_length": args.seq_length,
                          "num_samples": len(results), "max_samples": args.max_samples, "seed": args.seed}}
    (out / "data_config.json").write_text(json.dumps(config, indent=2))
    section(log, "Data generation complete!")
    log.info("  Saved %d files to %s", len(results), out)
    return 0


# ---- speculators >= 0.5 --------------------------------------------------------------------------

def http(url: str, body: dict | None = None, timeout: float = 15) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def generate(args: argparse.Namespace, log: logging.Logger) -> tuple[int, list[int]]:
    samples = load_samples(args.preprocessed_data, None, None)
    out = Path(args.output) if args.output else Path(args.preprocessed_data) / "hidden_states"
    out.mkdir(parents=True, exist_ok=True)
    todo = list(range(len(samples)))[:args.max_samples] if args.max_samples else list(range(len(samples)))
    log.info(f"Processing {len(todo)} samples")
    model_id = http(f"{args.endpoint}/models")["data"][0]["id"]
    if args.model and args.model != model_id:
        raise ValueError(f"An explicit model name was passed ({args.model}) which doesn't match found model_id "
                         f"{model_id}.Please make sure --endpoint is set to the correct vllm instance.")
    limit = args.max_consecutive_errors or args.concurrency
    consecutive, skipped = 0, []
    with tqdm(total=len(todo), mininterval=0) as bar:
        for i in todo:
            time.sleep(STEP)
            try:
                reply = {}
                for attempt in range(1, args.max_retries + 2):
                    try:
                        reply = http(f"{args.endpoint}/completions",
                                     {"model": model_id, "prompt": samples[i], "max_tokens": 1,
                                      "return_token_ids": True}, timeout=args.request_timeout)
                        break
                    except OSError as e:
                        if attempt > args.max_retries:
                            raise
                        log.warning("Request aborted (attempt %d/%d): %s. Retrying in %ds...",
                                    attempt, args.max_retries + 1, e, 0)
                if reply["choices"][0]["prompt_token_ids"] != samples[i]:
                    raise RuntimeError("Prompt token IDs mismatch")
                shutil.move(reply["kv_transfer_params"]["hidden_states_path"], out / f"hs_{i}.safetensors")
            except Exception as e:
                if args.fail_on_error:
                    log.exception("Fatal: sample %d aborted with --fail-on-error: %s", i, e)  # noqa: TRY401 - verbatim
                    logging.shutdown()
                    os._exit(1)
                log.warning("Skipping sample %d due to error: %s", i, e)
                skipped.append(i)
                consecutive += 1
                if consecutive >= limit:
                    raise RuntimeError(f"Aborting: {limit} consecutive samples errored out. "
                                       "The vLLM server may be unreachable.") from e
            else:
                consecutive = 0
            finally:
                bar.update(1)
    log.info(f"Saved {len(todo) - len(skipped)} new data points to {args.output}")
    return len(todo) - len(skipped), skipped


def new_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="Generate EAGLE training data offline")
    ap.add_argument("--model", default=None)
    ap.add_argument("--endpoint", default="http://localhost:8000/v1")
    ap.add_argument("--preprocessed-data", default="./output")
    ap.add_argument("--max-samples", type=int, default=None)
    ap.add_argument("--output", default=None)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--validate-outputs", action="store_true")
    ap.add_argument("--request-timeout", type=float, default=15)
    ap.add_argument("--max-retries", type=int, default=3)
    ap.add_argument("--fail-on-error", action="store_true")
    ap.add_argument("--max-consecutive-errors", type=int, default=None)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=FORMAT)
    log = logging.getLogger("__main__")
    log.info("EAGLE Offline Data Generation")
    try:
        _, skipped = generate(args, log)
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("Data generation failed")
        return 1
    if skipped:
        log.warning(f"Skipped {len(skipped)} samples due to errors: {skipped}")
    log.info("Data generation complete!")
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    sys.exit(old_main(argv) if any(a.startswith("--target-model-path") for a in argv) else new_main(argv))
