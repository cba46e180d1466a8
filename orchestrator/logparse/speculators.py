"""speculators hidden-state generation: the old in-process vLLM pipeline and the new vLLM-server client."""

from __future__ import annotations

import re

from . import vllm
from .errors import Rule, rule

NAME = "speculators"

DETECT = re.compile(
    r"speculators|Generating hidden states|Data generation complete!|EAGLE Offline Data Generation"
    r"|data_generation_offline|hidden_states_generator"
)

RULES: list[Rule] = [
    rule(r"Data generation failed|Aborting: \d+ consecutive samples errored out"
         r"|Fatal: sample \d+ aborted", "other", True),
]

_FINISHED = re.compile(r"Data generation complete!")

metrics = vllm.metrics


def line_phase(text: str, phase: str = "starting") -> str | None:
    if _FINISHED.search(text):
        return "finished"
    # The old pipeline runs vLLM in-process, so vLLM's loading lines tell the phase too.
    found = vllm.line_phase(text, phase)
    return None if found == "ready" else found


def bar_phase(label: str) -> str | None:
    # 'Generating hidden states', 'Saving files', or the new pipeline's bar without a label.
    return "running"
