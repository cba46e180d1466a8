"""The playbooks orch ships: one module each, holding its Spec and its steps."""

from __future__ import annotations

from orchestrator.errors import UsageError
from orchestrator.playbook import Playbook

from .command import Command
from .extract_hidden_states import ExtractHiddenStates

PLAYBOOKS: dict[str, Playbook] = {pb.name: pb for pb in (Command(), ExtractHiddenStates())}


def get(name: str) -> Playbook:
    try:
        return PLAYBOOKS[name]
    except KeyError:
        raise UsageError(f"unknown playbook {name!r} (known: {', '.join(sorted(PLAYBOOKS))})") from None
