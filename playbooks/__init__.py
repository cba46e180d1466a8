"""The playbooks orch ships: one module each, holding its Spec and its steps."""

from __future__ import annotations

from orchestrator.errors import UsageError
from orchestrator.playbook import Playbook

from .bench_serving import BenchServing
from .command import Command
from .extract_hidden_states import ExtractHiddenStates
from .serve_eagle3 import ServeEagle3

PLAYBOOKS: dict[str, Playbook] = {pb.name: pb for pb in (Command(), ExtractHiddenStates(), ServeEagle3(), BenchServing())}


def get(name: str) -> Playbook:
    try:
        return PLAYBOOKS[name]
    except KeyError:
        raise UsageError(f"unknown playbook {name!r} (known: {', '.join(sorted(PLAYBOOKS))})") from None
