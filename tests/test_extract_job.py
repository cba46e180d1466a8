"""Tests of the extract-hidden-states job script, run as a real subprocess on the CPU."""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # imported where used: every worker collects this file, one runs it
    import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "playbooks" / "jobs" / "extract_hidden_states.py"
PROMPTS = REPO / "playbooks" / "data" / "prompts.jsonl"
FINAL_LINE = re.compile(
    r"^Extraction complete: (\d+) samples, (\d+) tokens, [\d.]+ tokens/s -> (.+)$"
)


@dataclass
class RunRecord:
    returncode: int
    stdout: str
    stderr: str
    out_dir: Path

    @property
    def lines(self) -> list[str]:
        """stderr split the way a log watcher sees it: tqdm redraws with \\r."""
        return [line for line in re.split(r"[\r\n]+", self.stderr) if line.strip()]


def run_job(out_dir: Path, *args: str, script: Path = SCRIPT, timeout: float = 120) -> RunRecord:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), "--output-dir", str(out_dir), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=out_dir.parent, check=False,
    )
    return RunRecord(proc.returncode, proc.stdout, proc.stderr, out_dir)


def load_job_module():
    """The script's own prompt parser, so tests tokenize exactly what the job saw."""
    spec = importlib.util.spec_from_file_location("extract_hidden_states", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


def load_all_shards(out_dir: Path, manifest: dict) -> dict[str, torch.Tensor]:
    from safetensors import torch as safetensors_torch

    tensors: dict[str, torch.Tensor] = {}
    for shard in manifest["shards"]:
        path = out_dir / shard["file"]
        assert hashlib.sha256(path.read_bytes()).hexdigest() == shard["sha256"]
        loaded = safetensors_torch.load_file(str(path))
        assert len({k.split(".")[0] for k in loaded}) == shard["samples"]
        tensors.update(loaded)
    return tensors


def check_output(run: RunRecord, prompts: list[str], layers: list[int], model_dir: Path) -> dict:
    """Common checks: manifest, shapes, tokens and the hidden states themselves."""
    import torch
    import transformers

    assert run.returncode == 0, run.stderr
    manifest = json.loads((run.out_dir / "manifest.json").read_text())
    assert manifest["layers"] == layers
    assert manifest["samples"] == len(prompts)
    hidden = manifest["hidden_size"]
    tensors = load_all_shards(run.out_dir, manifest)

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model = model.to(getattr(torch, manifest["dtype"])).eval()
    total_tokens = 0
    for idx, text in enumerate(prompts):
        ids = tensors[f"s{idx}.input_ids"]
        expected_ids = tokenizer(text, truncation=True, max_length=manifest["max_length"])["input_ids"]
        assert ids.tolist() == expected_ids
        total_tokens += len(ids)
        # Unbatched, unpadded reference: the padded batch must give the same states.
        with torch.no_grad():
            ref = model(input_ids=ids[None], output_hidden_states=True).hidden_states
        per_layer = []
        for n in layers:
            t = tensors[f"s{idx}.layer{n}"]
            assert t.shape == (len(ids), hidden)
            assert t.dtype == getattr(torch, manifest["dtype"])
            torch.testing.assert_close(t.float(), ref[n + 1][0].float(), rtol=2e-2, atol=2e-2)
            per_layer.append(t)
        for a, b in itertools.pairwise(per_layer):
            assert not torch.allclose(a.float(), b.float())
    assert manifest["tokens"] == total_tokens
    assert manifest["tokens_per_s"] > 0

    match = FINAL_LINE.match(run.lines[-1])
    assert match, run.lines[-1]
    assert int(match.group(1)) == len(prompts) and int(match.group(2)) == total_tokens
    return manifest


def progress_states(run: RunRecord) -> list[str]:
    return [line for line in run.lines if line.startswith("Extracting hidden states:")]


# ------------------------------------------------------------------ built-in tiny model


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> RunRecord:
    return run_job(tmp_path_factory.mktemp("default") / "out")


def test_default_run_writes_manifest_and_shards(default_run: RunRecord):
    prompts = load_job_module().load_prompts(PROMPTS, None)
    assert len(prompts) >= 30
    tiny_dir = default_run.out_dir.parent / "tiny-model"
    manifest = check_output(default_run, prompts, [2, 4, 5], tiny_dir)
    assert manifest["num_layers"] == 8
    assert manifest["model"] == "tiny-random-llama"
    assert len(manifest["shards"]) >= 2  # several samples per shard, several shards
    assert "hidden_states[n + 1]" in manifest["convention"]
    # The tiny checkpoint is split like a big model's.
    assert len(list(tiny_dir.glob("model-*-of-*.safetensors"))) == 4


def test_default_run_progress_lines(default_run: RunRecord):
    lines = default_run.lines
    states = progress_states(default_run)
    assert len(states) >= 4  # 0%, per batch of 8 out of 32, 100%
    assert re.match(r"Extracting hidden states:\s+0%\|", states[0])
    assert re.match(r"Extracting hidden states: 100%\|.*\| 32/32 \[", states[-1])
    assert any(line.startswith("Loaded model ") and "layers=8" in line for line in lines)
    # transformers draws its own weight-loading bar (name differs across versions).
    assert any(re.match(r"(Loading weights|Loading checkpoint shards): 100%", line) for line in lines)
    assert lines[-1].startswith("Extraction complete: 32 samples, ")
    assert default_run.stdout == ""


# ------------------------------------------------------------------ options and datasets


def test_layers_and_max_samples_with_prompts_beside_script(tmp_path: Path):
    # orch uploads the script and prompts.jsonl into one remote directory.
    remote = tmp_path / "remote"
    remote.mkdir()
    script = Path(shutil.copy(SCRIPT, remote))
    shutil.copy(PROMPTS, remote)
    run = run_job(tmp_path / "out", "--layers", "[1,3]", "--max-samples", "5",
                  "--batch-size", "2", "--samples-per-shard", "2", script=script)
    prompts = load_job_module().load_prompts(PROMPTS, 5)
    manifest = check_output(run, prompts, [1, 3], tmp_path / "tiny-model")
    assert [s["samples"] for s in manifest["shards"]] == [2, 2, 1]
    assert manifest["dataset"] == str((remote / "prompts.jsonl").resolve())
    assert re.match(r"Extracting hidden states: 100%\|.*\| 5/5 \[", progress_states(run)[-1])


def test_jsonl_dataset_written_by_test(tmp_path: Path):
    records = [
        {"text": "Alpha beta gamma."},
        {"prompt": "A longer prompt, so that the batch needs padding to line up."},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    ]
    dataset = tmp_path / "mine.jsonl"
    dataset.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    run = run_job(tmp_path / "out", "--dataset", str(dataset), "--layers", "0,7", "--max-length", "24")
    prompts = ["Alpha beta gamma.", records[1]["prompt"], "Hi\nHello!"]
    manifest = check_output(run, prompts, [0, 7], tmp_path / "tiny-model")
    assert manifest["samples_at_max_length"] == 1  # the long prompt is cut to 24 tokens


# ------------------------------------------------------------------ a model from elsewhere


def save_small_gpt2(model_dir: Path, words: list[str]) -> None:
    """A GPT-2 shaped model with a word-level tokenizer that has no pad token."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="[UNK]"
    )
    config = transformers.GPT2Config(vocab_size=len(vocab), n_positions=64, n_embd=32,
                                     n_layer=4, n_head=2)
    torch.manual_seed(1)
    transformers.GPT2LMHeadModel(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def test_external_model_directory(tmp_path: Path):
    prompts = ["the cat sat on the mat", "a dog", "the dog ran after the cat today"]
    dataset = tmp_path / "p.jsonl"
    dataset.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    model_dir = tmp_path / "gpt2-small-test"
    save_small_gpt2(model_dir, " ".join(prompts).split())

    run = run_job(tmp_path / "out", "--model", str(model_dir), "--dataset", str(dataset),
                  "--layers", "0,3", "--dtype", "bfloat16", "--device", "cpu")
    manifest = check_output(run, prompts, [0, 3], model_dir)
    assert manifest["model"] == str(model_dir)
    assert (manifest["num_layers"], manifest["hidden_size"], manifest["dtype"]) == (4, 32, "bfloat16")
    assert not (tmp_path / "tiny-model").exists()


# ------------------------------------------------------------------ argument errors


def test_out_of_range_layer_exits_2_with_one_line(tmp_path: Path):
    run = run_job(tmp_path / "out", "--layers", "2,8", "--max-samples", "1")
    assert run.returncode == 2
    errors = [line for line in run.lines if "error" in line.lower()]
    assert errors == [
        "extract_hidden_states.py: error: --layers: 8 out of range; the model has 8 layers (valid 0..7)"
    ]
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--layers", "two"], "expected integers"),
    (["--max-samples", "0"], "must be >= 1"),
    (["--dataset", "/nonexistent/prompts.jsonl"], "--dataset: no such file"),
])
def test_bad_arguments_exit_2(tmp_path: Path, args: list[str], message: str):
    run = run_job(tmp_path / "out", *args)
    assert run.returncode == 2
    assert message in run.stderr
    assert "Traceback" not in run.stderr
