#!/usr/bin/env python3
"""Tests-only stand-in for `python -m sglang.benchmark.serving`: prints what SGLang 0.5.23 prints.

It first asks the server's /health (and fails the way the real one does when the server is not ready),
then draws a tqdm bar over the prompts and prints the real result block: a header centred in 50 `=`,
rows `{label:<40} {value:<10}`, sections centred in 50 `-`, a closing line of 50 `=`. The figures are
derived from the arguments and the measured duration, so every run prints its own.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def health(base_url: str) -> int | None:
    try:
        return urllib.request.urlopen(base_url + "/health", timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def bar(n: int, total: int, elapsed: float) -> str:
    rate = n / elapsed if elapsed > 0 and n else 0.0
    filled = int(10 * n / total)
    rate_s = f"{rate:5.2f}it/s" if rate else "?it/s"
    remaining = f"00:{int((total - n) / rate):02d}" if rate else "?"
    return f"{100 * n / total:3.0f}%|{'█' * filled}{' ' * (10 - filled)}| {n}/{total} [00:{int(elapsed):02d}<{remaining}, {rate_s}]"


def row(label: str, value: object) -> None:
    text = f"{value:<10.2f}" if isinstance(value, float) else f"{value!s:<10}"
    print(f"{label:<40} {text}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="sglang")
    ap.add_argument("--base-url")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--dataset-name", default="sharegpt")
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=1024)
    ap.add_argument("--request-time", type=float, default=0.005)
    ap.add_argument("--hold", metavar="FILE", help="after the warmup, wait until the test creates FILE "
                    "(FILE.reached says it waits)")
    args, _unknown = ap.parse_known_args()

    code = health(args.base_url)
    if code != 200:
        print(f"Server at {args.base_url}/health is not ready (answer: {code}). Exiting.")
        return 1
    print(f"benchmark_args=Namespace(backend='{args.backend}', base_url='{args.base_url}', "
          f"dataset_name='{args.dataset_name}', num_prompts={args.num_prompts})")
    print(f"#Input tokens: {args.num_prompts * args.random_input_len}")
    print(f"#Output tokens: {args.num_prompts * args.random_output_len}")
    print("Starting warmup with 1 sequences...")
    print("Warmup completed with 1 sequences. Starting main benchmark run...")
    sys.stdout.flush()
    if args.hold:
        Path(f"{args.hold}.reached").touch()
        while not Path(args.hold).exists():
            time.sleep(0.02)
    n, t0 = args.num_prompts, time.time()
    sys.stderr.write("\r" + bar(0, n, 0.0))
    for i in range(1, n + 1):
        time.sleep(args.request_time)
        sys.stderr.write("\r" + bar(i, n, time.time() - t0))
        sys.stderr.flush()
    sys.stderr.write("\n")
    sys.stderr.flush()

    # its numbers are those of the requests it was told to emulate, not of how busy this machine is
    duration = max(n * args.request_time, 1e-3)
    total_in, total_out = n * args.random_input_len, n * args.random_output_len
    concurrency = float(args.max_concurrency or n)
    print("\n{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Backend:", args.backend)
    row("Traffic request rate:", "inf")
    row("Max request concurrency:", args.max_concurrency or "not set")
    row("Successful requests:", n)
    row("Benchmark duration (s):", duration)
    row("Total input tokens:", total_in)
    row("Total input text tokens:", total_in)
    row("Total generated tokens:", total_out)
    row("Total generated tokens (retokenized):", total_out)
    row("Request throughput (req/s):", n / duration)
    row("Input token throughput (tok/s):", total_in / duration)
    row("Output token throughput (tok/s):", total_out / duration)
    row("Peak output token throughput (tok/s):", 1.5 * total_out / duration)
    row("Peak concurrent requests:", int(concurrency))
    row("Total token throughput (tok/s):", (total_in + total_out) / duration)
    row("Concurrency:", concurrency)
    row("Accept length:", 3.21)
    print("{s:{c}^{n}}".format(s="End-to-End Latency", n=50, c="-"))
    for stat, k in (("Mean", 1.0), ("Median", 0.9), ("P90", 1.6), ("P95", 1.8), ("P99", 2.2)):
        row(f"{stat} E2E Latency (ms):", 1000 * duration * k / max(1, n / concurrency))
    print("{s:{c}^{n}}".format(s="Time to First Token", n=50, c="-"))
    for stat, k in (("Mean", 1.0), ("Median", 0.8), ("P90", 1.7), ("P95", 2.0), ("P99", 2.9)):
        row(f"{stat} TTFT (ms):", 12.5 * k)
    print("{s:{c}^{n}}".format(s="Time per Output Token (excl. 1st token)", n=50, c="-"))
    for stat, k in (("Mean", 1.0), ("Median", 0.95), ("P90", 1.3), ("P95", 1.4), ("P99", 1.9)):
        row(f"{stat} TPOT (ms):", 10.64 * k)
    print("{s:{c}^{n}}".format(s="Inter-Token Latency", n=50, c="-"))
    for stat, k in (("Mean", 1.0), ("Median", 0.7), ("P90", 2.1), ("P95", 2.6), ("P99", 4.0), ("Max", 9.0)):
        row(f"{stat} ITL (ms):", 33.3 * k)
    print("=" * 50)
    return 0


if __name__ == "__main__":
    sys.exit(main())
