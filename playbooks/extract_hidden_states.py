"""`extract-hidden-states`: capture a causal LM's hidden states of chosen layers for draft-model training.

Backends:
  hf           orch's own transformers job (jobs/extract_hidden_states.py) into safetensors shards.
  speculators  the speculators repo's scripts on the host; the installed speculators version picks the
               pipeline: up to 0.4.x `data_generation_offline.py` runs vLLM in-process and writes
               `data_{i}.pt`; from 0.5 `launch_vllm.py` starts a vLLM server that the new
               `data_generation_offline.py` asks for each sample's `hs_{i}.safetensors`.

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
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.playbook import (
    FindRun,
    Host,
    JobContext,
    OrchError,
    Outputs,
    Playbook,
    Prepared,
    Remote,
    Run,
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
DEFAULT_PORT = 8000  # vLLM's
VERSION_VAR = "ORCH_SPECULATORS_VERSION"  # the version prepare() chose by, recorded in job.sh
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
                                "speculators <0.5: --train-data-path; >=0.5: preprocessed data dir")
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
    scripts_dir: str | None = Field(default=None, description="the speculators repo's scripts/ dir on the host")
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
        missing = [f for f in ("model", "dataset", "scripts_dir") if getattr(self, f) is None]
        if missing:
            raise ValueError(f"backend speculators needs {', '.join(missing)}")
        defaults = type(self).model_fields
        wrong = [f for f in ("max_length", "dtype", "device") if getattr(self, f) != defaults[f].default]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: only for backend hf")
        return self


VERSION_PY = ("import importlib.metadata as m\ntry:\n print('version', m.version('speculators'))\n"
              "except m.PackageNotFoundError:\n print('version none')")


def installed_speculators(remote: Remote, python: str) -> tuple[str, str]:
    """The speculators the host's python has ("none" when it has none, or could not say) and what the
    python printed, for an error message."""
    res = remote.run_argv([python, "-c", VERSION_PY], check=False, timeout=120)
    said = res.stdout + res.stderr
    found = next((line.split(" ", 1)[1] for line in res.stdout.splitlines() if line.startswith("version ")), "none")
    return found, said


def parse_version(text: str) -> tuple[int, ...]:
    m = VERSION_RE.match(text.strip())
    if not m:
        raise OrchError(f"not a speculators version: {text.strip()!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def pipeline_of(version: str) -> Literal["old", "new"]:
    return "new" if parse_version(version) >= NEW_PIPELINE else "old"


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


def endpoint(s: ExtractSpec) -> str:
    return f"http://127.0.0.1:{s.port or DEFAULT_PORT}/v1"


def generator_argv(s: ExtractSpec, python: str, out: str) -> list[str]:
    assert s.scripts_dir and s.model and s.dataset
    argv = [python, posixpath.join(s.scripts_dir, GENERATOR), "--model", s.model, "--endpoint", endpoint(s),
            "--preprocessed-data", s.dataset, "--output", out]
    for flag, value in (("--max-samples", s.max_samples), ("--concurrency", s.batch_size)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def shell(argv: list[str]) -> str:
    return " ".join(quote(a) for a in argv)


def server_command(s: ExtractSpec, python: str, store: str | None = None, headless: bool = False) -> str:
    """The server's shell line; on several nodes with vLLM's multi-node rendezvous, filled in by each node."""
    line = shell(server_argv(s, python, store))
    if s.nodes == 1:
        return line
    return f"{line} {shell(['--distributed-executor-backend', 'mp'])} {rendezvous('torchrun')}" + (
        f" {shell(HEADLESS)}" if headless else "")


def new_pipeline_script(s: ExtractSpec, python: str, out: str, store: str | None = None) -> str:
    """Server in the background, wait for it, generate, and stop the server whatever happened. On several
    nodes every node but the head runs only its headless share of the server, in the foreground."""
    port = str(s.port or DEFAULT_PORT)
    health = f"http://127.0.0.1:{port}/health"
    worker = [other_nodes_only(server_command(s, python, store, headless=True))] if s.nodes > 1 else []
    return "\n".join([
        f"{shell([python, WAIT, 'free', '127.0.0.1', port])} || exit 1",
        *worker,
        f"{server_command(s, python, store)} &",
        "server=$!",
        # vLLM shuts its engine processes down on SIGTERM; give it 60 s before SIGKILL.
        ('stop_server() { kill -TERM "$server" 2>/dev/null || return 0; for _ in $(seq 600); do '
         'kill -0 "$server" 2>/dev/null || return 0; sleep 0.1; done; kill -KILL "$server" 2>/dev/null; }'),
        "trap stop_server EXIT",
        f"{shell([python, WAIT, 'up', health, '--timeout', f'{s.server_timeout:g}'])} --pid \"$server\" || exit 1",
        shell(generator_argv(s, python, out)),
    ]) + "\n"


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

    def output_dir(self, job: JobContext[ExtractSpec]) -> str:
        # a relative output_dir is the job's, in its run dir: checked, cleared and counted there too
        return posixpath.join(job.paths.root, job.spec.output_dir or "hidden_states")

    def preflight(self, job: JobContext[ExtractSpec]) -> None:
        s = job.spec
        if s.nodes > 1 and s.backend == "speculators" and not s.speculators_version and not job.dry_run:
            version, _ = installed_speculators(job.remote, job.python)
            if VERSION_RE.match(version) and pipeline_of(version) == "old":
                raise UsageError(MULTI_NODE)
        if job.spec.output_dir:
            self._output_dir_entries(job)  # refuses a non-empty one before cleanup or patches touch the host

    def prepare(self, job: JobContext[ExtractSpec]) -> Prepared:
        if job.spec.output_dir and job.spec.clear_output:
            self._clear_output_dir(job)
        if job.spec.backend == "hf":
            for name, src in ((SCRIPT, JOBS / SCRIPT), (PROMPTS, DATA / PROMPTS)):
                job.remote.put(src.read_bytes(), posixpath.join(job.paths.root, name))
            return Prepared()
        version = self._speculators_version(job)
        if pipeline_of(version) == "new":
            job.remote.put((JOBS / WAIT).read_bytes(), posixpath.join(job.paths.root, WAIT))
        return Prepared(env={VERSION_VAR: version})

    def _output_dir_entries(self, job: JobContext[ExtractSpec]) -> tuple[int, str]:
        """Old and new shards in one directory are indistinguishable to a trainer: a non-empty output_dir
        is refused unless clear_output says to empty it. (entries, KiB) of what is there."""
        held = job.remote.usage(self.output_dir(job))
        entries, kib = (held.entries, str(held.kib)) if held is not None else (0, "?")
        if entries and not job.spec.clear_output:
            raise UsageError(f"output_dir {self.output_dir(job)} is not empty ({entries} entries, {kib} KiB); "
                             "set clear_output = true to clear it first")
        return entries, kib

    def _clear_output_dir(self, job: JobContext[ExtractSpec]) -> None:
        entries, kib = self._output_dir_entries(job)
        if entries:
            # the trailing slash: a symlink to the folder is cleared as it was counted, through it
            job.remote.run_argv(["find", self.output_dir(job).rstrip("/") + "/", "-mindepth", "1", "-delete"],
                                timeout=600)
            job.event("prepare", f"cleared output_dir {self.output_dir(job)}: {entries} entries, {kib} KiB")

    def _speculators_version(self, job: JobContext[ExtractSpec]) -> str:
        """The installed version (unless the spec forces one) and the scripts present."""
        s = job.spec
        assert s.scripts_dir  # the spec's validator requires it for this backend
        version, said = (s.speculators_version, "") if s.speculators_version else installed_speculators(
            job.remote, job.python)
        scripts = {name for name in (GENERATOR, LAUNCHER) if job.remote.is_file(posixpath.join(s.scripts_dir, name))}
        if job.dry_run:
            return s.speculators_version or ".".join(map(str, NEW_PIPELINE))
        if version == "none" or not VERSION_RE.match(version):
            raise OrchError(f"speculators is not installed for {job.python} on {job.host.name} "
                            f"(set speculators_version to choose the pipeline): {said.strip()[-200:]}")
        needed = [GENERATOR] + ([LAUNCHER] if pipeline_of(version) == "new" else [])
        absent = [n for n in needed if n not in scripts]
        if absent:
            raise OrchError(f"{', '.join(absent)} not found in {s.scripts_dir} on {job.host.name} "
                            "(scripts_dir: the scripts/ folder of the speculators repo)")
        job.event("prepare", f"speculators {version}: {pipeline_of(version)} pipeline")
        return version

    def command(self, job: JobContext[ExtractSpec], prepared: Prepared) -> str:
        s = job.spec
        out = self.output_dir(job)
        if s.backend == "speculators":
            if pipeline_of(prepared.env[VERSION_VAR]) == "old":
                if s.nodes > 1:
                    raise UsageError(MULTI_NODE)
                return shell(old_argv(s, job.python, out))
            return new_pipeline_script(s, job.python, out, posixpath.join(job.paths.root, STORE_DIR))
        args = [job.python, SCRIPT, "--output-dir", out,
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

    def finish(self, job: JobContext[ExtractSpec], run: Run) -> Outputs:
        if job.spec.backend == "speculators":
            return self._count_outputs(job)
        if run.status is not Status.SUCCEEDED:
            return Outputs()
        path = posixpath.join(self.output_dir(job), "manifest.json")
        text = job.remote.read_text(path)
        if text is None:
            raise OrchError(f"{path}: no manifest (not a plain file on {job.host.name})")
        try:
            manifest = json.loads(text)
        except json.JSONDecodeError:
            raise OrchError(f"{path}: not a JSON manifest") from None
        if not isinstance(manifest, dict):
            raise OrchError(f"{path}: not a JSON object")
        metrics = [(k, float(manifest[k])) for k in ("samples", "tokens", "tokens_per_s")
                   if isinstance(manifest.get(k), int | float)]
        return Outputs(manifest, metrics)

    def _count_outputs(self, job: JobContext[ExtractSpec]) -> Outputs:
        """Sample files of either pipeline, all files and their bytes (also after a failure)."""
        out = self.output_dir(job)
        entries = job.remote.list_dir(out) or []
        held = job.remote.usage(out)
        pt = sum(1 for e in entries if fnmatch.fnmatchcase(e.name, "data_*.pt"))
        hs = sum(1 for e in entries if fnmatch.fnmatchcase(e.name, "hs_*.safetensors"))
        files = sum(1 for e in entries if e.kind == "file")
        size = held.bytes if held is not None else 0
        found = {"output_dir": out, "data_pt": pt, "hs_safetensors": hs, "samples": pt + hs, "files": files,
                 "bytes": size}
        return Outputs(found, [("samples", pt + hs), ("files", files), ("output_mb", round(size / 2**20, 3))])
