"""`extract-hidden-states`: capture a causal LM's hidden states of chosen layers into safetensors shards."""

from __future__ import annotations

import json
import posixpath
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from orchestrator.errors import OrchError
from orchestrator.playbook import Playbook, RunContext
from orchestrator.remote import quote
from orchestrator.spec import RunSpec

JOBS = Path(__file__).parent / "jobs"
DATA = Path(__file__).parent / "data"
SCRIPT = "extract_hidden_states.py"
PROMPTS = "prompts.jsonl"


class ExtractSpec(RunSpec):
    backend: Literal["hf"] = "hf"
    model: str | None = Field(default=None, description="model dir on the host; none builds a tiny random Llama")
    dataset: str | None = Field(default=None, description="JSONL prompts on the host; none uses orch's own")
    layers: list[int] | None = Field(default=None, description="layer indices; default [2, L//2, L-3]")
    output_dir: str | None = Field(default=None, description="default: <run dir>/hidden_states")
    max_samples: int = Field(default=32, gt=0)
    batch_size: int = Field(default=4, gt=0)
    max_length: int = Field(default=256, gt=0)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")


class ExtractHiddenStates(Playbook):
    name = "extract-hidden-states"
    Spec = ExtractSpec
    engine = "transformers"

    def output_dir(self, ctx: RunContext) -> str:
        assert isinstance(ctx.spec, ExtractSpec)
        return ctx.spec.output_dir or posixpath.join(ctx.paths.root, "hidden_states")

    def prepare(self, ctx: RunContext) -> None:
        for name, src in ((SCRIPT, JOBS / SCRIPT), (PROMPTS, DATA / PROMPTS)):
            ctx.transport.put(src.read_bytes(), posixpath.join(ctx.paths.root, name))

    def command(self, ctx: RunContext) -> str:
        s = ctx.spec
        assert isinstance(s, ExtractSpec)
        args = [ctx.python, SCRIPT, "--output-dir", self.output_dir(ctx),
                "--max-samples", str(s.max_samples), "--batch-size", str(s.batch_size),
                "--max-length", str(s.max_length), "--dtype", s.dtype, "--device", s.device]
        if s.model:
            args += ["--model", s.model]
        if s.dataset:
            args += ["--dataset", s.dataset]
        if s.layers is not None:
            args += ["--layers", ",".join(map(str, s.layers))]
        return " ".join(quote(a) for a in args)

    def finish(self, ctx: RunContext, run: dict[str, Any]) -> None:
        if run["status"] != "succeeded":
            return
        path = posixpath.join(self.output_dir(ctx), "manifest.json")
        text = ctx.transport.run(f"cat {quote(path)}").stdout
        try:
            manifest = json.loads(text)
        except json.JSONDecodeError:
            raise OrchError(f"{path}: not a JSON manifest") from None
        (ctx.ws.run_dir(ctx.run_id) / "outputs.json").write_text(json.dumps(manifest, indent=2))
        samples = [(k, float(manifest[k]), None) for k in ("samples", "tokens", "tokens_per_s") if k in manifest]
        ctx.store.add_metrics(ctx.run_id, samples, run["ended_at"] or 0)
