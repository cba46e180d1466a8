"""`command`: supervise any command line — the way to put any job under orch."""

from __future__ import annotations

import shlex

from pydantic import Field, field_validator

from orchestrator.playbook import Playbook, RunContext
from orchestrator.spec import RunSpec, check_regex


class CommandSpec(RunSpec):
    cmd: str = Field(min_length=1, description="command line, run by bash in the run dir unless cwd is set")
    cwd: str | None = None
    ready_pattern: str | None = Field(default=None, description="regex of the line that marks the job ready")
    engine: str | None = Field(default=None, description="log format hint: sglang, vllm, speculators, ...")

    _regex = field_validator("ready_pattern")(classmethod(lambda cls, v: check_regex(v)))


class Command(Playbook):
    name = "command"
    Spec = CommandSpec

    def command(self, ctx: RunContext) -> str:
        assert isinstance(ctx.spec, CommandSpec)
        return ctx.spec.cmd  # the user's own command line, run as given

    def engine_argv(self, spec: RunSpec) -> list[str] | None:
        assert isinstance(spec, CommandSpec)
        try:
            return shlex.split(spec.cmd)
        except ValueError:
            return spec.cmd.split()

    def cwd(self, ctx: RunContext) -> str | None:
        assert isinstance(ctx.spec, CommandSpec)
        return ctx.spec.cwd
