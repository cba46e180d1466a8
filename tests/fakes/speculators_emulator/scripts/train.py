#!/usr/bin/env python3
"""Tests-only stand-in for speculators' scripts/train.py (EAGLE-3 draft training), 0.4.x and 0.5.x on.

Its argument parser takes the real script's flags of the version in SPECULATORS_EMULATOR_TRAIN_VERSION
(default 0.4.0): from 0.5 `--data-path` is the preprocessed dataset and `--hidden-states-path` the
`hs_{i}.safetensors` folder, before it `--data-path` holds `data_{i}.pt` (0.7+'s config resolver builds
its config from the same flags). From 0.5 the layers the samples hold must be `--target-layer-ids` (default
[2, n//2, n-3]) plus the last layer, else it fails on the shape as the real one does. It logs as the real trainer does
through Rich off a terminal ('[HH:MM:SS] INFO     message   file.py:N', later lines of the same second
without the time): `Training epoch K/N started|completed`, one `train/loss=..., epoch=E, lr=...` line per
step, and saves SAVE_PATH/<epoch>/ checkpoints. No sample files: exits 1 with a traceback, as the real
one fails to build its dataset. Test knob: SPECULATORS_EMULATOR_STEP_TIME seconds per step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

VERSION = tuple(int(p) for p in os.environ.get("SPECULATORS_EMULATOR_TRAIN_VERSION", "0.4.0").split(".")[:2])
STEP = float(os.environ.get("SPECULATORS_EMULATOR_STEP_TIME", "0.01"))
_last = [""]


def log(message: str, where: str, level: str = "INFO") -> None:
    stamp = time.strftime("[%X]")
    shown = stamp if stamp != _last[0] else " " * len(stamp)
    _last[0] = stamp
    sys.stderr.write(f"{shown} {level:<8} {message:<60} {where}\n")
    sys.stderr.flush()


def fmt(v: float) -> str:
    return f"{v:.2e}" if abs(v) < 0.001 or abs(v) > 999 else f"{v:.3f}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--verifier-name-or-path", type=str, required=True)
    ap.add_argument("--speculator-type", type=str, default="eagle3")
    if VERSION >= (0, 5):
        ap.add_argument("--from-pretrained", type=str, default="")
        ap.add_argument("--data-path", type=str, default="./output")
        ap.add_argument("--hidden-states-path", type=str, default=None)
        ap.add_argument("--vllm-endpoint", type=str, default="http://localhost:8000/v1")
        ap.add_argument("--on-missing", choices=["generate", "skip", "warn", "raise"], default="generate")
        ap.add_argument("--on-generate", choices=["cache", "delete"], default="delete")
        ap.add_argument("--request-timeout", type=float, default=600.0)
        ap.add_argument("--max-retries", type=int, default=3)
        ap.add_argument("--legacy-data", action="store_true")
        ap.add_argument("--save-path", type=str, default="./output/checkpoints")
    else:
        ap.add_argument("--data-path", type=str, default="./data")
        ap.add_argument("--save-path", type=str, default="./checkpoints")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--no-resume-from-checkpoint", action="store_true")
    ap.add_argument("--logger", type=str, default="")
    ap.add_argument("--total-seq-len", type=int, default=8192)
    if VERSION >= (0, 5):
        ap.add_argument("--log-freq", type=int, default=1)
    ap.add_argument("--log-dir", type=str, default="./logs")
    ap.add_argument("--run-name", type=str, default=None)
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--draft-arch", type=str, default="llama")
    if VERSION >= (0, 5):
        ap.add_argument("--draft-hidden-act", type=str, default=None)
        ap.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
        ap.add_argument("--token-freq-path", type=str, default=None)
        ap.add_argument("--draft-vocab-size", type=int, default=None)
    ap.add_argument("--d2t-path", type=str, default=None)
    ap.add_argument("--t2d-path", type=str, default=None)
    if VERSION >= (0, 5):
        ap.add_argument("--mask-token-id", type=int, default=None)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--ttt-step-loss-decay", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42)
    if VERSION >= (0, 5):
        ap.add_argument("--hidden-states-dtype", type=str, default="bfloat16")
    ap.add_argument("--deterministic-cuda", action="store_true", default=False)
    ap.add_argument("--use-off-policy-tokens", action="store_true", default=False)
    ap.add_argument("--norm-before-residual", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--embed-requires-grad", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--num-workers", type=int, default=12)
    ap.add_argument("--prefetch-factor", type=int, default=4)
    ap.add_argument("--noise-std", type=float, default=0.05)
    ap.add_argument("--scheduler-type", type=str, default="linear")
    ap.add_argument("--scheduler-warmup-steps", type=int, default=None)
    ap.add_argument("--scheduler-total-steps", type=int, default=None)
    ap.add_argument("--scheduler-num-cosine-cycles", type=float, default=0.5)
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if VERSION >= (0, 5):
        folder = Path(args.hidden_states_path or Path(args.data_path) / "hidden_states")
        samples = sorted(folder.glob("hs_*.safetensors"))
    else:
        folder = Path(args.data_path)
        samples = sorted(folder.glob("data_*.pt"))
    if samples and VERSION >= (0, 5):
        from safetensors.numpy import load_file

        held = load_file(str(samples[0]))["hidden_states"].shape[0]
        wanted = len(args.target_layer_ids or [2, 16, 29]) + 1
        if held != wanted:
            sys.stderr.write("Traceback (most recent call last):\n"
                             '  File "scripts/train.py", line 380, in <module>\n    main(parse_args())\n'
                             f"RuntimeError: shape mismatch: the samples hold {held} hidden states, the "
                             f"target layers and the last layer are {wanted}\n")
            return 1
    if not samples:
        sys.stderr.write("Traceback (most recent call last):\n"
                         '  File "scripts/train.py", line 380, in <module>\n    main(parse_args())\n'
                         f"ValueError: no training samples found in {folder}\n")
        return 1
    save = Path(args.save_path)
    steps = max(1, len(samples) // 2)
    step = 0
    for epoch in range(args.epochs):
        log(f"Training epoch {epoch + 1}/{args.epochs} started", "trainer.py:242")
        for _ in range(steps):
            time.sleep(STEP)
            loss_0 = 3.0 * math.exp(-0.1 * step)
            metrics = {f"train/loss_{i}": loss_0 * (1 + 0.1 * i) for i in range(args.ttt_steps)}
            metrics |= {f"train/full_acc_{i}": 1 - loss_0 / 4 for i in range(args.ttt_steps)}
            metrics["train/loss"] = sum(v for k, v in metrics.items() if "loss_" in k)
            text = ", ".join(f"{k}={fmt(v)}" for k, v in metrics.items())
            log(f"{text}, epoch={epoch:d}, lr={fmt(args.lr)}", "trainer.py:191")
            step += 1
        log(f"Training epoch {epoch + 1}/{args.epochs} completed", "trainer.py:244")
        log("No val loader, skipping validation epoch", "trainer.py:250", "WARNING")
        log(f"Started saving checkpoint to {save / str(epoch)}", "trainer.py:259")
        (save / str(epoch)).mkdir(parents=True, exist_ok=True)
        (save / str(epoch) / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
        log(f"Finished saving checkpoint to {save / str(epoch)}", "trainer.py:263")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
