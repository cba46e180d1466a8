"""Training logs of any trainer, read by shape rather than by trainer:

  - a Python dict or JSON line of numbers, Hugging Face Trainer's `{'loss': 2.31, 'grad_norm': 1.2,
    'learning_rate': 4.9e-05, 'epoch': 0.12}` (values may be quoted), and its last word
    `{'train_runtime': ...}`;
  - a progress bar's postfix, `key=value` pairs (Lightning's `v_num=0, train_loss=2.61`, tqdm's
    `set_postfix`, NeMo's `reduced_train_loss=2.34, global_step=9.000`);
  - a step line: a step, iteration or epoch number and `key: value`, `key=value` or `key value` pairs,
    separated by '|' or ',' (Megatron's `iteration 100/ 1000 | ... | lm loss: 3.45E+00 |`, NeMo and
    SpecForge's `Epoch 1, Step 120, Loss: 3.25, LR: 1e-4`, `step 120 | loss 3.25 | lr 1e-4`,
    `step=120 loss=3.25 lr=1e-4`);
  - Keras's bar, `640/1200 [====>....] - ETA: 3:12 - loss: 0.3011 - accuracy: 0.8950`;
  - a trainer's or job's last word ('Training completed', Lightning's '`Trainer.fit` stopped', Megatron's
    '[after training is done]', 'exited with code 0').

Names are the keys as printed, in snake case ('lm loss' -> lm_loss, 'elapsed time per iteration (ms)' ->
elapsed_time_per_iteration_ms). So that every trainer's loss, learning rate and step are found under one
name too, the first key of a line that means one of them is also recorded as `loss`, `lr` or `step`.
"""

from __future__ import annotations

import re

from .protocol import as_printed

_NUMBER = r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_VALUE = _NUMBER + r"|nan|-?inf"  # where a value's end is marked (`, } -`): a diverged loss prints nan
_DICT_PAIR = re.compile(r"['\"]([^'\"]{1,60})['\"]\s*:\s*['\"]?(" + _VALUE + r")['\"]?\s*(?=[,}])")
_POSTFIX_PAIR = re.compile(r"(?:^|,)\s*([A-Za-z_][\w./-]{0,60})=(" + _VALUE + r")(?=\s*(?:,|$))")
# A step, iteration or epoch and its number, as a word of its own ('global_step=9', 'Step 120',
# 'iteration  100/').
_STEP_WORD = re.compile(r"(?:^|[\s|,\[(])(?:global[ _])?(?:step|iteration|iter|epoch)s?\s*[:=]?\s*\[?\d",
                        re.IGNORECASE)
_SEGMENT = re.compile(r"^\s*([A-Za-z_][\w ./()-]{0,60}?)\s*(?:[:=]\s*|\s+)\[?(" + _NUMBER
                      + r")(?:/\s*\d+)?\]?\s*(?:%|[A-Za-z]{1,3}(?:/[A-Za-z]{1,7})?|[A-Za-z]{1,7}/s)?\s*$")  # a unit, not prose
_SPACED_PAIR = re.compile(r"(?:^|(?<=\s))([A-Za-z_][\w./-]{0,60})=(" + _VALUE + r")(?=\s|,|$)")
_TRAINER_KEY = re.compile(r"loss|\blr\b|learning_rate|epoch|step|grad_norm|reward|accuracy|\bacc|perplexity"
                          r"|train_runtime|eval_", re.IGNORECASE)
_MAX_PAIRS = 64
_LEAD_TIME = re.compile(r"^\s*\[[^\]]{0,40}\]\s*")  # Megatron's ' [2026-01-10 10:00:00] iteration ...'

# The key that means the loss, the learning rate or the step, in the trainers' spellings.
_ALIASES = (
    ("loss", re.compile(r"^(?:loss|lm_loss|train_loss|reduced_train_loss|train/loss|total_loss"
                        r"|train_loss_step)$")),
    ("lr", re.compile(r"^(?:lr|learning_rate|lr/\w+)$")),
    ("step", re.compile(r"^(?:step|global_step|iteration|iter|train/global_step)$")),
)


def snake(key: str) -> str:
    """'lm loss' -> lm_loss, 'elapsed time per iteration (ms)' -> elapsed_time_per_iteration_ms; keys with
    '/' or '.' (train/loss, lr/AdamW) keep them."""
    return re.sub(r"[^\w/.]+", "_", key.strip().lower()).strip("_")


def _named(pairs: list[tuple[str, str]], aliases: bool = True) -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    for key, raw in pairs[:_MAX_PAIRS]:
        value = as_printed(raw)  # `loss=nan` is kept: the run diverged
        if value is not None:
            found.append((snake(key), value))
    if aliases:
        names = {n for n, _ in found}
        for alias, pattern in _ALIASES:
            if alias in names:
                continue
            first = next(((n, v) for n, v in found if pattern.match(n)), None)
            if first is not None:
                found.append((alias, first[1]))
    return found


def dict_metrics(text: str) -> list[tuple[str, float]]:
    """The numbers of a dict line a trainer printed; [] for any other line (or a dict of no trainer)."""
    t = text.strip()
    if not (t.startswith("{") and t.endswith("}")) or not _TRAINER_KEY.search(t):
        return []
    pairs = _DICT_PAIR.findall(t)
    # The run's summary (`train_runtime`, `train_loss` averaged over the run) is no step's loss.
    return _named(pairs, aliases="'train_runtime'" not in t and '"train_runtime"' not in t)


def postfix_metrics(postfix: str) -> list[tuple[str, float]]:
    """`key=value` pairs of a progress bar's postfix (', loss=2.61, v_num=0')."""
    if "=" not in postfix:
        return []
    return _named(_POSTFIX_PAIR.findall(postfix))


_LABEL_PAIR = re.compile(r"([A-Za-z_][\w ./-]{0,40}?)\s*[:=]\s*(" + _NUMBER + r")(?![\w.])")


def label_metrics(label: str) -> list[tuple[str, float]]:
    """A trainer's numbers in a bar's label (torchtune's '1|26|Loss: 1.79'); a bar of anything else ('bs=512
    avail_mem=20.5 GB') has none."""
    if ":" not in label and "=" not in label:
        return []
    pairs = [(k, v) for k, v in _LABEL_PAIR.findall(label) if _TRAINER_KEY.search(k)]
    return _named(pairs)


# Keras's bar: ' 640/1200 [===============>..............] - ETA: 3:12 - loss: 0.3011 - accuracy: 0.8950', at
# the end of an epoch '1200/1200 [====] - 412s 343ms/step - loss: 0.3120 - val_loss: 0.3544'.
_KERAS = re.compile(r"^\s*(\d+)/(\d+) \[[=>.]*\] - (.*)$")
_KERAS_PAIR = re.compile(r"(?:^| - )([A-Za-z_][\w/]{0,60}): (" + _VALUE + r")(?= - |\s*$)")


def keras_bar(text: str) -> tuple[float, float, list[tuple[str, float]]] | None:
    """(done, total, metrics) of a Keras progress line; None for any other line."""
    if " [=" not in text and " [." not in text:
        return None
    m = _KERAS.match(text)
    if m is None or int(m.group(2)) <= 0:
        return None
    return float(m.group(1)), float(m.group(2)), _named(_KERAS_PAIR.findall(m.group(3)))


def training_postfix(postfix: str) -> bool:
    """Whether a bar's postfix reports a trainer's numbers ('loss=2.61'): the bar is a training loop's."""
    return "=" in postfix and any(_TRAINER_KEY.search(k) for k, _ in _POSTFIX_PAIR.findall(postfix))


# HF example scripts' summary rows under '***** train metrics *****': '  train_loss               =     1.2345'.
_SUMMARY_ROW = re.compile(r"^  ((?:train|eval|predict|test)_\w+|epoch)\s+=\s+(" + _NUMBER + r")\s*$")


def summary_metrics(text: str) -> list[tuple[str, float]]:
    """A row of a Trainer script's metrics summary; [] for any other line."""
    if " = " not in text:
        return []
    m = _SUMMARY_ROW.match(text)
    return _named([(m.group(1), m.group(2))], aliases=False) if m else []


def step_metrics(text: str) -> list[tuple[str, float]]:
    """The pairs of a trainer's step line; [] unless the line names a step, iteration or epoch and holds at
    least two numbers."""
    low = text.lower()
    if ("step" not in low and "iter" not in low and "epoch" not in low) or not _STEP_WORD.search(text):
        return []
    sep = "|" if "|" in text else ","
    pairs: list[tuple[str, str]] = []
    for part in _LEAD_TIME.sub("", text).split(sep):
        m = _SEGMENT.match(part)
        if m:
            pairs.append((m.group(1), m.group(2)))
    if len(pairs) < 2:  # 'step=100 loss=2.31 lr=1e-4': pairs separated by spaces alone
        pairs = _SPACED_PAIR.findall(text)
    return _named(pairs) if len(pairs) >= 2 else []


# A trainer's or a job's own last word.
DONE = re.compile(
    r"\b(?:[Tt]raining|[Gg]eneration|[Ee]xtraction|[Ee]valuation|[Bb]enchmark|[Jj]ob|[Ff]ine-?tuning)"
    r" (?:is |has |have )?(?:finished|complete|completed|done|ended)\b(?! with errors?\b)"
    r"|\b(?:Finished|Done) (?:training|generation|extraction|evaluation|fine-?tuning)\b"
    r"|\{'train_runtime': |`Trainer\.fit` stopped: "  # HF Trainer's and Lightning's last words
    r"|^\*{5} train metrics \*{5}$"  # HF example scripts' summary after training
    r"|^\[after training is done\]"  # Megatron
    r"|\b(?:[Ee]xit(?:ed)?|[Rr]eturned)(?: with)?(?: exit)? (?:code|status)[:=]? ?0\.?\s*$|\bexit 0\s*$"
)
