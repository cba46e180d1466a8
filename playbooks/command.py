"""`command`: supervise any command line — the way to put any job under orch."""

from __future__ import annotations

import shlex

from pydantic import Field, field_validator

from orchestrator.playbook import RunContext, Playbook, Prepared, RunSpec, check_regex


class CommandSpec(RunSpec):
    cmd: str = Field(min_length=1, description="command line, run by bash in the run dir unless cwd is set")
    cwd: str | None = Field(default=None, description="working dir on the host (default: the run dir)")
    ready_pattern: str | None = Field(default=None, description="regex of the line that marks the job ready")
    engine: str | None = Field(default=None, description="log format hint: sglang, vllm, speculators, ...")

    _regex = field_validator("ready_pattern")(classmethod(lambda cls, v: check_regex(v)))


class Command(Playbook[CommandSpec]):
    name = "command"
    Spec = CommandSpec
    multi_node = True  # the command reads NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT itself

    def command(self, run: RunContext[CommandSpec], prepared: Prepared) -> str:
        return run.spec.cmd  # the user's own command line, run as given

    def engine_argv(self, spec: CommandSpec) -> list[str] | None:
        try:
            return shlex.split(spec.cmd)
        except ValueError:
            return spec.cmd.split()

    def cwd(self, spec: CommandSpec) -> str | None:
        return spec.cwd

    def ready_pattern(self, spec: CommandSpec) -> str | None:
        return spec.ready_pattern

    def log_engine(self, spec: CommandSpec) -> str | None:
        return spec.engine
