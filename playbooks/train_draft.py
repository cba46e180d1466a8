"""`train-draft`: train an EAGLE-3 draft model on extracted hidden states with speculators' trainer.

The step after `extract-hidden-states` (backend speculators). The hidden states come from a finished
extract run (`from_run = N`: its output_dir on the same host) or from a path (`hidden_states`). The
speculators version installed for the host's python (or `speculators_version`) picks the arguments, as
scripts/train.py names them:
  0.3.x-0.4.x  --data-path is the folder of `data_{i}.pt` files the old extraction wrote.
  0.5.x on     --data-path is the preprocessed dataset, --hidden-states-path the `hs_{i}.safetensors`
               folder, --on-missing what to do for a sample without hidden states, --target-layer-ids the
               layers the hidden states hold (else train.py assumes [2, n//2, n-3]): the extract run's
               `layers`, or this spec's `layers` when the hidden states are given by path.
From 0.7 train.py's config resolver builds its config from these same flags (v0.7.0, v0.7.0.1,
hsc-v0.7.0 and the later resolvers), and its log lines are unchanged: 0.7+ runs with the 0.5 arguments.
0.9 has no scripts/ (train.py was a shim over the package in 0.8): `python -m speculators.train` takes the
same flags, and scripts_dir is not needed. With from_run, the extract run's prepare-data output (0.9, when
its dataset was not preprocessed) is the default data_path.

On several nodes (`nodes` > 1) train.py runs under torchrun (`python -m torch.distributed.run`, FSDP as
speculators' TRAINING.md launches it), one process per visible GPU of each node, with torchrun's static
rendezvous from the node's environment; on one node it runs as a single process, as before. The hidden
states, the dataset and the save path must then be on a filesystem every node sees.

The trainer logs through Rich: each step a `train/loss=…, train/full_acc_0=…, epoch=0, lr=…` line, each
epoch `Training epoch K/N started|completed`; the log parser reads both (loss metrics, epoch progress).
"""

from __future__ import annotations

import posixpath
import re

from pydantic import Field, field_validator, model_validator

from orchestrator.playbook import (
    FindRun,
    Host,
    RunContext,
    NotFound,
    OrchError,
    Outputs,
    Playbook,
    Prepared,
    RunRecord,
    RunSpec,
    Status,
    UsageError,
    rendezvous,
)

from .extract_hidden_states import (
    DATASET_INFO,
    PREPARED_DIR,
    VERSION_RE,
    VERSION_VAR,
    installed_speculators,
    parse_version,
    shell,
)

TRAINER = "train.py"
EPOCH = re.compile(r"[0-9]+")  # a checkpoint folder's name
EXTRACT = "extract-hidden-states"
NEW_ARGS = (0, 5)  # --hidden-states-path, --on-missing and --target-layer-ids from here on
CLI_TRAINER = (0, 9)  # no scripts/ from here on: the package's own trainer module, the same flags
TRAINER_MODULE = ["-m", "speculators.train"]
# Rich wraps its log lines at the console width, 80 columns off a terminal: room for a whole metrics line.
COLUMNS = "400"
TORCHRUN = ["-m", "torch.distributed.run"]  # torchrun, as the host's python has it


class TrainDraftSpec(RunSpec):
    scripts_dir: str | None = Field(default=None, description="<0.9: the speculators repo's scripts/ dir on the "
                                    "host (0.9 on: none, its package's trainer runs)")
    verifier: str = Field(description="--verifier-name-or-path: the target model the hidden states came from")
    from_run: int | None = Field(default=None, gt=0, le=2**53, description="a succeeded extract-hidden-states run "
                                 "(backend speculators) on this host: its output_dir is the hidden states")
    hidden_states: str | None = Field(default=None, description="the hidden-states dir, instead of from_run")
    data_path: str | None = Field(default=None, description=">=0.5: --data-path, the preprocessed dataset "
                                  "(default: the extract run's dataset)")
    output_dir: str | None = Field(default=None, description="--save-path (default: <run dir>/checkpoints)")
    epochs: int | None = Field(default=None, gt=0, le=1_000_000, description="--epochs (script default 20)")
    lr: float | None = Field(default=None, gt=0, le=100, description="--lr (script default 1e-4)")
    total_seq_len: int | None = Field(default=None, gt=0, le=10**9, description="--total-seq-len: tokens packed per "
                                      "batch, the script's batch size (default 8192)")
    num_layers: int | None = Field(default=None, gt=0, le=10_000, description="--num-layers of the draft model")
    on_missing: str | None = Field(default=None, pattern=r"^(generate|skip|warn|raise)$",
                                   description=">=0.5: --on-missing (default here: warn)")
    layers: list[int] | None = Field(default=None, description=">=0.5, with hidden_states: --target-layer-ids, "
                                     "the layers extracted (with from_run: the extract run's)")
    speculators_version: str | None = Field(default=None, description="force the arguments (default: installed)")
    extra_args: list[str] = Field(default_factory=list, description="more train.py flags, passed as given")

    @field_validator("speculators_version")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        if v is not None and not VERSION_RE.match(v):
            raise ValueError(f"not a version: {v!r}")
        return v

    @field_validator("scripts_dir", "verifier", "hidden_states", "data_path", "output_dir")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty (leave it out for the default)")
        return v

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or len(set(v)) != len(v) or min(v) < 0):
            raise ValueError("layers must be distinct indices >= 0")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> TrainDraftSpec:
        if (self.from_run is None) == (self.hidden_states is None):
            raise ValueError("give exactly one of from_run (an extract run) and hidden_states (a path)")
        if self.from_run is not None and self.layers is not None:
            raise ValueError("layers: with from_run the layers are the extract run's; give layers only with "
                             "hidden_states")
        return self


def extract_run(find_run: FindRun, spec: TrainDraftSpec, host: Host) -> RunRecord:
    """The extract run `from_run` names: succeeded, backend speculators, on this host."""
    assert spec.from_run is not None
    try:
        run = find_run(spec.from_run)
    except NotFound:
        raise UsageError(f"from_run: no run {spec.from_run}") from None
    where = f"from_run: run {run.id} ({run.playbook} on {run.host}, {run.status})"
    if run.playbook != EXTRACT or run.spec.get("backend") != "speculators":
        raise UsageError(f"{where} is not an {EXTRACT} run with backend speculators")
    if run.host != host.name:
        raise UsageError(f"{where} is not on {host.name}")
    if run.status is not Status.SUCCEEDED:
        raise UsageError(f"{where} did not succeed")
    if not run.spec.get("output_dir") and not run.remote_dir:
        raise UsageError(f"{where} has no output_dir on record")
    if run.spec.get("include_last_layer") is False:
        # train.py takes the last layer it finds as the verifier's own (its logits are the target) and the
        # layers before it as the draft's input: without it, a target layer is taken for it (shape mismatch)
        raise UsageError(f"{where} left out the verifier's last layer (include_last_layer = false), which "
                         "speculators' train.py needs as its training target; extract again without it")
    return run


def hidden_states_dir(find_run: FindRun, spec: TrainDraftSpec, host: Host) -> str:
    if spec.hidden_states is not None:
        return spec.hidden_states
    run = extract_run(find_run, spec, host)
    return str(run.spec.get("output_dir") or posixpath.join(str(run.remote_dir), "hidden_states"))


def dataset_dir(find_run: FindRun, spec: TrainDraftSpec, host: Host, prepared: str | None = None) -> str | None:
    """The preprocessed dataset: the spec's, else the extract run's prepare-data output (`prepared`, when the
    host has it), else the extract run's dataset."""
    if spec.data_path is not None or spec.from_run is None:
        return spec.data_path
    if prepared is not None:
        return prepared
    dataset = extract_run(find_run, spec, host).spec.get("dataset")
    return str(dataset) if dataset else None


def prepared_dir(find_run: FindRun, spec: TrainDraftSpec, host: Host) -> str | None:
    """Where the extract run's prepare-data wrote, if it ran there (speculators >= 0.9)."""
    if spec.from_run is None or spec.data_path is not None:
        return None
    run = extract_run(find_run, spec, host)
    return posixpath.join(str(run.remote_dir), PREPARED_DIR) if run.remote_dir else None


def target_layers(find_run: FindRun, spec: TrainDraftSpec, host: Host) -> list[int] | None:
    """The layers the hidden states hold: the spec's, or the extract run's; None for the scripts' default."""
    if spec.from_run is None:
        return spec.layers
    layers = extract_run(find_run, spec, host).spec.get("layers")
    return [int(n) for n in layers] if layers else None


def train_argv(s: TrainDraftSpec, python: str, version: str, hidden: str, data: str | None,
               save: str, layers: list[int] | None = None) -> list[str]:
    if parse_version(version) >= CLI_TRAINER:
        argv = [python, *TRAINER_MODULE, "--verifier-name-or-path", s.verifier]
    else:
        assert s.scripts_dir, "checked by prepare"
        argv = [python, posixpath.join(s.scripts_dir, TRAINER), "--verifier-name-or-path", s.verifier]
    if parse_version(version) >= NEW_ARGS:
        if data is None:
            raise UsageError("speculators >= 0.5 needs data_path (the preprocessed dataset) or a from_run "
                             "whose spec names its dataset")
        argv += ["--data-path", data, "--hidden-states-path", hidden, "--on-missing", s.on_missing or "warn"]
        if layers is not None:
            argv += ["--target-layer-ids", *map(str, layers)]
    else:
        argv += ["--data-path", hidden]
    argv += ["--save-path", save]
    for flag, value in (("--epochs", s.epochs), ("--lr", s.lr), ("--total-seq-len", s.total_seq_len),
                        ("--num-layers", s.num_layers)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + list(s.extra_args)


def train_command(argv: list[str], nodes: int) -> str:
    """train.py's shell line: itself on one node; under torchrun, one process per GPU, on several."""
    if nodes == 1:
        return shell(argv)
    python, script = argv[0], argv[1:]
    return f"{shell([python, *TORCHRUN])} {rendezvous('torchrun')} {shell(['--nproc-per-node', 'gpu', *script])}"


class TrainDraft(Playbook[TrainDraftSpec]):
    name = "train-draft"
    Spec = TrainDraftSpec
    engine = "speculators"
    multi_node = True

    def check_inputs(self, spec: TrainDraftSpec, host: Host, find_run: FindRun) -> None:
        if spec.from_run is not None:
            extract_run(find_run, spec, host)

    def output_dir(self, run: RunContext[TrainDraftSpec]) -> str:
        # a relative output_dir is the job's, in its run dir: its checkpoints are counted there too
        return posixpath.join(run.paths.root, run.spec.output_dir or "checkpoints")

    def prepare(self, run: RunContext[TrainDraftSpec]) -> Prepared:
        return Prepared(env={VERSION_VAR: self._version(run), "COLUMNS": COLUMNS})

    def _version(self, run: RunContext[TrainDraftSpec]) -> str:
        """The installed version (unless the spec forces one) and, before 0.9, whether train.py is there."""
        s = run.spec
        version, said = (s.speculators_version, "") if s.speculators_version else installed_speculators(
            run.remote, run.python)
        found = s.scripts_dir is not None and run.remote.is_file(posixpath.join(s.scripts_dir, TRAINER))
        if run.dry_run:
            return s.speculators_version or ".".join(map(str, NEW_ARGS if s.scripts_dir else CLI_TRAINER))
        if version == "none" or not VERSION_RE.match(version):
            raise OrchError(f"speculators is not installed for {run.python} on {run.host.name} "
                            f"(set speculators_version): {said.strip()[-200:]}")
        if parse_version(version) >= CLI_TRAINER:
            unused = f"; scripts_dir {s.scripts_dir} is not used" if s.scripts_dir else ""
            run.event("prepare", f"speculators {version}: python -m speculators.train{unused}")
            return version
        if not found:
            where = f"not found in {s.scripts_dir}" if s.scripts_dir else "needed (set scripts_dir)"
            raise OrchError(f"{TRAINER} {where} on {run.host.name} (scripts_dir: the scripts/ folder of the "
                            f"speculators repo, for speculators {version}; 0.9 on has none and needs none)")
        run.event("prepare", f"speculators {version}: train.py {'>=0.5' if parse_version(version) >= NEW_ARGS else '<0.5'} arguments")
        return version

    def command(self, run: RunContext[TrainDraftSpec], prepared: Prepared) -> str:
        hidden = hidden_states_dir(run.find_run, run.spec, run.host)
        prepared_by = prepared_dir(run.find_run, run.spec, run.host)
        if prepared_by is not None and not run.remote.is_file(posixpath.join(prepared_by, DATASET_INFO)):
            prepared_by = None  # the extract run's dataset was preprocessed already
        data = dataset_dir(run.find_run, run.spec, run.host, prepared_by)
        layers = target_layers(run.find_run, run.spec, run.host)
        argv = train_argv(run.spec, run.python, prepared.env[VERSION_VAR], hidden, data, self.output_dir(run), layers)
        return train_command(argv, run.spec.nodes)

    def finish(self, run: RunContext[TrainDraftSpec], record: RunRecord) -> Outputs:
        """The checkpoints (one folder per epoch, named by its number) train.py saved, also after a failure."""
        out = self.output_dir(run)
        epochs = sorted((e.name for e in run.remote.list_dir(out) or [] if e.kind == "dir" and EPOCH.fullmatch(e.name)),
                        key=int)
        held = run.remote.usage(out)
        checkpoints, size = len(epochs), held.bytes if held is not None else 0
        last = posixpath.join(out, epochs[-1]) if epochs else None
        found = {"output_dir": out, "hidden_states": hidden_states_dir(run.find_run, run.spec, run.host),
                 "checkpoints": checkpoints, "last_checkpoint": last, "bytes": size}
        return Outputs(found, [("checkpoints", checkpoints), ("output_mb", round(size / 2**20, 3))])
