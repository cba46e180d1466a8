"""HF transformers jobs and any other program: only progress bars tell the phase."""

from __future__ import annotations

import re

from .errors import Rule

TRANSFORMERS = "transformers"

# Transformers' shard bar, a warning from inside the library, or its Trainer's log dicts.
DETECT_TRANSFORMERS = re.compile(r"Loading checkpoint shards|transformers/|transformers\."
                                 r"|^\{'(?:loss|train_runtime|eval_loss)': ")

RULES: list[Rule] = []

# uvicorn's own lines on SIGINT/SIGTERM (every server behind it: vLLM's, SGLang's): a stop was asked for.
SHUTDOWN = re.compile(r"^INFO:\s+(?:Shutting down|Waiting for application shutdown\.)$")

# Bars that mean the same in every engine.
_LOADING_BAR = re.compile(r"checkpoint shards|loading shards|^Loading (?:weights|model)", re.IGNORECASE)
_CAPTURING_BAR = re.compile(r"^(?:Capturing|Compiling num tokens)")  # SGLang compiles piecewise graphs


def metrics(text: str) -> list[tuple[str, float]]:
    return []


def line_phase(text: str, phase: str = "starting") -> str | None:
    return None


def common_bar_phase(label: str) -> str | None:
    if _LOADING_BAR.search(label):
        return "loading"
    if _CAPTURING_BAR.match(label):
        return "capturing"
    return None


def bar_phase(label: str) -> str | None:
    return "running"
