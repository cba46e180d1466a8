"""speculators: hidden-state generation (the old in-process vLLM pipeline, the new vLLM-server client) and
EAGLE-3 draft training (scripts/train.py, 0.3 to 0.7).

The trainer logs through Rich with its dict formatter: a step is `train/loss=1.234, train/full_acc_0=0.512,
..., epoch=0, lr=1.00e-04`, a validation pass `val/loss_epoch=..., epoch=0`; each pair under `train/` or
`val/` is a metric of that name, `lr` too (0.7 prints one per optimizer: `lr/AdamW=...`). `Training epoch
K/N started|completed` is the run's progress (K-1 or K of N epochs): its per-step bars are Rich's, which
draw nothing off a terminal."""

from __future__ import annotations

import re

from . import vllm
from .errors import Rule, rule
from .protocol import as_printed

DETECT = re.compile(
    r"speculators|Generating hidden states|Data generation complete!|EAGLE Offline Data Generation"
    r"|data_generation_offline|hidden_states_generator|Training epoch \d+/\d+ started"
)

RULES: list[Rule] = [
    rule(r"Data generation failed|Aborting: \d+ consecutive samples errored out"
         r"|Fatal: sample \d+ aborted", "other", True, versions="0.5-0.7",
         source="scripts/data_generation_offline.py"),
]

_FINISHED = re.compile(r"Data generation complete!")

metrics = vllm.metrics

_TRAIN_LINE = re.compile(r"(?:^|[\s,])(?:train|val)/\w+=")
_TRAIN_PAIR = re.compile(r"(?:^|(?<=[\s,]))((?:train|val)/\w+|lr(?:/\w+)?)=(-?\d+(?:\.\d+)?(?:e[+-]?\d+)?|nan|-?inf)(?=,|\s|$)")
_EPOCH = re.compile(r"\bTraining epoch (\d+)/(\d+) (started|completed)\b")
_MAX_PAIRS = 64


def train_metrics(text: str) -> list[tuple[str, float]]:
    """The trainer's step and validation metrics: [] for any other line."""
    if "/" not in text or not _TRAIN_LINE.search(text):
        return []
    found = [(name, as_printed(value)) for name, value in _TRAIN_PAIR.findall(text)[:_MAX_PAIRS]]
    return [(n, v) for n, v in found if v is not None]  # `train/loss=nan` kept: the run diverged


def epoch_progress(text: str) -> tuple[float, float] | None:
    """(epochs done, epochs) of a `Training epoch K/N started|completed` line."""
    if "Training epoch" not in text:
        return None
    m = _EPOCH.search(text)
    if m is None:
        return None
    k, n = int(m.group(1)), int(m.group(2))
    if n <= 0 or not 0 < k <= n:
        return None
    return float(k if m.group(3) == "completed" else k - 1), float(n)


def line_phase(text: str, phase: str = "starting") -> str | None:
    if _FINISHED.search(text):
        return "finished"
    # The old pipeline runs vLLM in-process, so vLLM's loading lines tell the phase too.
    found = vllm.line_phase(text, phase)
    return None if found == "ready" else found


def bar_phase(label: str) -> str | None:
    # 'Generating hidden states', 'Saving files', or the new pipeline's bar without a label.
    return "running"
