"""The inventory: hosts.toml plus the built-in `local` host."""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import HostError, UsageError
from .checks import DAY_S, GPUS_MAX, bad_env_names, passable, unprintable
from .workspace import LOCAL

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"


class Host(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str = Field(pattern=NAME_PATTERN)
    address: str | None = None  # defaults to the name, so an ~/.ssh/config alias works
    user: str | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    identity_file: str | None = None
    known_hosts: str | None = None  # checked in addition to ~/.ssh/known_hosts
    gpus: int = Field(default=0, ge=0, le=GPUS_MAX)
    workdir: str = "~/orch"
    python: str = "python3"
    env: dict[str, str] = {}
    # env names shown as *** besides those that look secret (as a spec's `secret_env`): a dry run shows the job's script
    secret_env: list[str] = []
    tags: list[str] = []
    accept_new_host_key: bool = False
    # Several Unix users share the workdir (a group-writable folder): its `leases/` may be another user's.
    shared_workdir: bool = False
    poll_min: float | None = Field(default=None, gt=0, le=DAY_S)
    poll_max: float | None = Field(default=None, gt=0, le=DAY_S)
    connect_timeout: float = Field(default=10, gt=0, le=3600)
    # A run whose host has not answered for this long ends `lost` (its job may live on, unwatchable).
    unreachable_give_up_s: float = Field(default=86400.0, gt=0, le=365 * DAY_S)
    # A multi-node run's other nodes reach this host, when it is the head, at this address (default: its
    # address, as orch reaches it); the interface its ranks talk over (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME).
    node_address: str | None = None
    ifname: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.:@-]{1,15}$")
    # A batch scheduler: jobs go through it (the address is its login node; none: this machine's).
    scheduler: Literal["slurm"] | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str | None = None  # sbatch --time, e.g. "4:00:00"
    constraint: str | None = None
    sbatch_args: list[str] = []  # more sbatch options, each one word: ["--exclusive", "--mem=0"]

    _passable = field_validator("*")(classmethod(lambda cls, value: passable(value)))

    @field_validator("env", "secret_env")
    @classmethod
    def _env_names(cls, env: Any) -> Any:
        bad = bad_env_names(env)
        if bad:
            raise ValueError(f"not an environment variable name: {bad[0]!r}")
        return env

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, workdir: str) -> str:
        # a relative path would depend on the directory each SSH session happens to start in
        if not workdir.startswith(("/", "~")):
            raise ValueError(f"must be an absolute path or start with ~, got {workdir!r}")
        # only the login user's own home is expanded (~, ~/x): ~root/x would be a folder named "~root"
        if workdir.startswith("~") and workdir != "~" and not workdir.startswith("~/"):
            raise ValueError(f"~ only as the login user's home (~ or ~/...), got {workdir!r}: give the other "
                             "home's absolute path")
        char = unprintable(workdir)  # a newline or other control character would split the lines it is in
        if char:
            raise ValueError(f"holds a character that is not printable ({char}): {workdir!r}")
        return workdir

    @property
    def is_local(self) -> bool:
        return self.name == LOCAL

    @property
    def on_this_machine(self) -> bool:
        """Commands run here, not over SSH: the local host, or a cluster whose scheduler is this machine's."""
        return self.is_local or (self.scheduler is not None and self.address is None)


def local_host(workspace_root: Path, overrides: dict[str, Any] | None = None) -> Host:
    fields: dict[str, Any] = {"workdir": str(workspace_root), "python": sys.executable}
    fields.update(overrides or {})
    fields["name"] = LOCAL
    return Host(**fields)


class Inventory:
    def __init__(self, hosts: dict[str, Host]):
        self.hosts = hosts

    @classmethod
    def load(cls, path: Path, workspace_root: Path) -> Inventory:
        raw: Any = {}
        if path.exists():
            try:
                raw = tomllib.loads(path.read_text()).get("hosts", {})
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise UsageError(f"{path}: invalid TOML: {exc}") from None
            except OSError as exc:  # a directory, no permission
                raise UsageError(f"cannot read hosts file {path}: {exc.strerror or exc}") from None
            if not isinstance(raw, dict):
                raise UsageError(f"{path}: hosts: expected tables [hosts.NAME], got {type(raw).__name__}")
        elif path.name != "hosts.toml":
            raise UsageError(f"hosts file not found: {path}")
        hosts: dict[str, Host] = {}
        problems: list[str] = []
        for name, fields in raw.items():
            if not isinstance(fields, dict):
                problems.append(f"hosts.{name}: expected a table")
                continue
            if "name" in fields:
                problems.append(f"hosts.{name}.name: not a field (the table's name is the host's)")
                continue
            try:
                if name == LOCAL:
                    hosts[name] = local_host(workspace_root, fields)
                else:
                    hosts[name] = Host(name=name, **fields)
            except ValidationError as exc:
                problems += [
                    f"hosts.{name}.{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}"
                    for e in exc.errors()
                ]
        if problems:
            raise UsageError(f"{path}: " + "; ".join(problems))
        hosts.setdefault(LOCAL, local_host(workspace_root))
        return cls(hosts)

    def get(self, name: str) -> Host:
        try:
            host = self.hosts[name]
        except KeyError:
            known = ", ".join(sorted(self.hosts))
            raise HostError(f"unknown host {name!r} (known: {known})") from None
        check_usable(host)
        return host

    def select(self, names: list[str] | None = None, tags: list[str] | None = None) -> list[Host]:
        if names:
            return [self.get(n) for n in names]
        hosts = [h for h in self.hosts.values() if not h.is_local]
        if tags:
            hosts = [h for h in hosts if set(tags) & set(h.tags)]
        for host in hosts:
            check_usable(host)
        return hosts


    def for_run(self, names: list[str], nodes: int) -> list[Host]:
        """The hosts a run spans, its head first: those named (`--host a --host b`), or `nodes` of the
        hosts tagged TAG (`--host @TAG`, by name). A cluster given alone spans `nodes` of its own."""
        if len(names) == 1 and names[0].startswith("@"):
            tag = names[0][1:]
            tagged = sorted(self.select(tags=[tag]), key=lambda h: h.name)
            if len(tagged) < nodes:
                raise UsageError(f"nodes = {nodes} but {len(tagged)} hosts have the tag {tag!r}"
                                 + (f" ({', '.join(h.name for h in tagged)})" if tagged else ""))
            return tagged[:nodes]
        hosts = [self.get(n) for n in names]
        if len(hosts) == 1 and nodes > 1 and hosts[0].scheduler is None:
            raise UsageError(f"nodes = {nodes} needs as many hosts: give --host once per node, or --host @TAG")
        return hosts


def check_usable(host: Host) -> None:
    """What can be checked here before connecting; a missing key file would otherwise be retried as
    if the host were down. Checked when a host is chosen, so one stale entry blocks no other host."""
    if host.identity_file and not os.path.isfile(os.path.expanduser(host.identity_file)):
        raise HostError(f"hosts.{host.name}.identity_file: no such file: {host.identity_file}")
