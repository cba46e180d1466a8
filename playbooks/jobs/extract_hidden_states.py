#!/usr/bin/env python3
"""Extract per-layer hidden states of a causal LM over a prompt set.

Job script of the built-in ``extract-hidden-states`` playbook (backend ``hf``).
It runs on the GPU host with the host's python and depends only on the stdlib,
torch, transformers (with its ``tokenizers`` dependency), safetensors and tqdm.

    python extract_hidden_states.py --output-dir DIR [--model PATH]
        [--dataset JSONL] [--layers 2,5,8 | --layers '[2,5,8]']
        [--max-samples N] [--batch-size B] [--max-length L]
        [--dtype float32|bfloat16|float16] [--device cpu|cuda|cuda:N|auto]
        [--tiny-shards N] [--samples-per-shard N]

Without ``--model`` a tiny random Llama is built, saved as a multi-shard
checkpoint next to the output dir and loaded back, so a smoke run exercises
the same loading path (and progress output) as a real model.

Output (in ``--output-dir``):
  hidden_states-00000.safetensors ...  per sample ``s{idx}.input_ids`` [seq]
                                        and ``s{idx}.layer{n}`` [seq, hidden]
  manifest.json                         run summary, see ``write_manifest``

Exit codes: 0 success, 2 bad arguments (one-line message), 1 anything else
(with the Python traceback).
"""

from __future__ import annotations

import os

# Never reach a model hub from the host: everything is loaded from local paths.
# Set before importing transformers, which reads these at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import transformers
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

PROG = "extract_hidden_states.py"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARD_PATTERN = "hidden_states-{:05d}.safetensors"
# Cap shard files so a big model with long prompts does not build one huge file.
MAX_SHARD_BYTES = 2 * 1024**3
CONVENTION = (
    "layer n is the output of decoder block n (0-based), i.e. "
    "hidden_states[n + 1] of transformers' output_hidden_states=True "
    "(hidden_states[0] is the embedding output and is not stored; for the last "
    "block transformers returns the output after the final norm). Only real "
    "tokens are stored (padding removed, right padding, BOS kept if the "
    "tokenizer adds one); tensors are [seq_len, hidden_size] in the model dtype."
)


class UsageError(Exception):
    """A problem with the command line or the files it names (exit code 2)."""


def log(message: str) -> None:
    # One stream for everything (tqdm bars and log lines) keeps the order intact
    # whatever way the job's output is captured.
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- CLI


def parse_layers(text: str) -> list[int]:
    """Accept ``2,5,8`` or a JSON-ish list ``[2, 5, 8]``."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    parts = [p.strip() for p in body.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"no layers in {text!r}")
    try:
        layers = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 2,5,8 or [2,5,8], got {text!r}"
        ) from None
    return sorted(set(layers))


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True, type=Path, help="where shards and manifest.json go")
    p.add_argument("--model", help="local model directory (default: build a tiny random Llama)")
    p.add_argument("--dataset", type=Path, help="JSONL prompts (default: the shipped prompts.jsonl)")
    p.add_argument("--layers", type=parse_layers, help="decoder blocks to capture (default: 2,L//2,L-3)")
    p.add_argument("--max-samples", type=positive_int, help="use only the first N prompts")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--max-length", type=positive_int, default=512, help="truncate prompts to this many tokens")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda if available)")
    p.add_argument("--tiny-shards", type=positive_int, default=4, help="checkpoint shards of the tiny model")
    p.add_argument("--samples-per-shard", type=positive_int, default=16, help="samples per output shard")
    return p


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: unknown device {name!r} (use cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this host")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: unsupported device {name!r} (use cpu, cuda, cuda:N or auto)")
    return device


# ----------------------------------------------------------------------- prompts


def default_dataset() -> Path:
    """The shipped prompts: in the repo (playbooks/data) or uploaded beside the script."""
    here = Path(__file__).resolve().parent
    candidates = [here.parent / "data" / "prompts.jsonl", here / "prompts.jsonl"]
    for path in candidates:
        if path.is_file():
            return path
    raise UsageError(
        "no --dataset given and no prompts.jsonl found at " + " or ".join(map(str, candidates))
    )


def prompt_text(record: Any, where: str) -> str:
    """A record is a string or an object with ``text``, ``prompt`` or ``messages``."""
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        for key in ("text", "prompt"):
            if isinstance(record.get(key), str):
                return record[key]
        messages = record.get("messages")
        if isinstance(messages, list):
            return "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    raise ValueError(f"{where}: expected a string or an object with text, prompt or messages")


def load_prompts(path: Path, limit: int | None) -> list[str]:
    if not path.is_file():
        raise UsageError(f"--dataset: no such file: {path}")
    prompts: list[str] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON: {exc}") from None
            text = prompt_text(record, where)
            if text.strip():  # an empty prompt has no tokens to capture
                prompts.append(text)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


# -------------------------------------------------------------------- tiny model


def build_tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level tokenizer built locally: every byte is a token, nothing to download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Prepend BOS like most real causal LM tokenizers do.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def build_tiny_model(model_dir: Path, shards: int) -> Path:
    """Save a small random Llama (fixed seed) split into about ``shards`` safetensors files."""
    tokenizer = build_tiny_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if model_dir.exists():
        shutil.rmtree(model_dir)  # rebuilt every run: deterministic and cheap
    # Shards are filled greedily tensor by tensor; 10% headroom keeps the count
    # at `shards` for small values instead of spilling into one extra file.
    model.save_pretrained(model_dir, max_shard_size=int(total_bytes / shards * 1.1) + 1)
    tokenizer.save_pretrained(model_dir)
    n_files = len(list(model_dir.glob("*.safetensors")))
    log(f"Built tiny random Llama at {model_dir}: layers={config.num_hidden_layers} "
        f"hidden={config.hidden_size} vocab={config.vocab_size} shards={n_files}")
    return model_dir


# ------------------------------------------------------------------------- model


def text_config(config: Any) -> Any:
    # Multimodal configs keep the language model's sizes in a sub-config.
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def default_layers(num_layers: int) -> list[int]:
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


def check_layers(layers: list[int], num_layers: int) -> None:
    bad = [n for n in layers if not 0 <= n < num_layers]
    if bad:
        raise UsageError(
            f"--layers: {', '.join(map(str, bad))} out of range; "
            f"the model has {num_layers} layers (valid 0..{num_layers - 1})"
        )


def dtype_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    # transformers renamed torch_dtype to dtype in 4.56; hosts may run either.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device) -> Any:
    kwargs: dict[str, Any] = {"local_files_only": True, **dtype_kwargs(dtype)}
    # device_map loads weights straight onto the GPU, but needs accelerate.
    use_device_map = device.type == "cuda" and importlib.util.find_spec("accelerate") is not None
    if use_device_map:
        kwargs["device_map"] = str(device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if not use_device_map:
        model = model.to(device)  # type: ignore[arg-type]  # transformers types .to as a module wrapper
    return model.eval()


def load_tokenizer(model_dir: str) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    # Right padding keeps the position ids of real tokens identical to an unpadded run.
    tokenizer.padding_side = "right"
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise ValueError(f"tokenizer of {model_dir} has no pad, eos or unk token to pad with")
        tokenizer.pad_token = fallback
    return tokenizer


# ------------------------------------------------------------------------ output


@dataclass
class ShardWriter:
    """Groups per-sample tensors into safetensors files of several samples each."""

    out_dir: Path
    samples_per_shard: int
    shards: list[dict[str, Any]] = field(default_factory=list)
    _tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    _sample_ids: list[int] = field(default_factory=list)
    _bytes: int = 0

    def add(self, idx: int, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self._tensors[f"s{idx}.{name}"] = tensor
            self._bytes += tensor.numel() * tensor.element_size()
        self._sample_ids.append(idx)
        if len(self._sample_ids) >= self.samples_per_shard or self._bytes >= MAX_SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self._sample_ids:
            return
        name = SHARD_PATTERN.format(len(self.shards))
        path = self.out_dir / name
        metadata = {"format": "pt", "sample_ids": json.dumps(self._sample_ids)}
        save_file(self._tensors, str(path), metadata=metadata)
        self.shards.append({
            "file": name,
            "samples": len(self._sample_ids),
            "first_sample": self._sample_ids[0],
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
        })
        self._tensors, self._sample_ids, self._bytes = {}, [], 0


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def clear_previous_output(out_dir: Path) -> None:
    # Shards left by an earlier, larger run would otherwise look like part of this one.
    for stale in [*out_dir.glob("hidden_states-*.safetensors"), out_dir / "manifest.json"]:
        stale.unlink(missing_ok=True)


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out_dir / "manifest.json")  # readers never see a half-written file


# -------------------------------------------------------------------- extraction


@dataclass
class Stats:
    samples: int = 0
    tokens: int = 0
    at_max_length: int = 0  # samples cut (or exactly fitting) at --max-length


@torch.inference_mode()
def extract(
    model: Any,
    tokenizer: Any,
    prompts: list[str],
    layers: list[int],
    args: argparse.Namespace,
    device: torch.device,
    writer: ShardWriter,
) -> Stats:
    # The base model yields the same hidden states without computing logits over
    # the whole vocabulary, which is large and unused here.
    body = model.base_model
    stats = Stats()
    bar = tqdm(total=len(prompts), desc="Extracting hidden states", file=sys.stderr, mininterval=0)
    for start in range(0, len(prompts), args.batch_size):
        batch = prompts[start:start + args.batch_size]
        enc = tokenizer(batch, padding=True, truncation=True, max_length=args.max_length,
                        return_tensors="pt")
        enc = {k: v.to(device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
        out = body(**enc, output_hidden_states=True, use_cache=False)
        mask = enc["attention_mask"].bool()
        for row, text in enumerate(batch):
            keep = mask[row]
            # Boolean indexing copies, so saved tensors never share storage.
            tensors = {"input_ids": enc["input_ids"][row][keep].cpu()}
            for n in layers:
                tensors[f"layer{n}"] = out.hidden_states[n + 1][row][keep].cpu()
            writer.add(start + row, tensors)
            stats.tokens += int(keep.sum())
            stats.at_max_length += int(int(keep.sum()) == args.max_length)
        stats.samples += len(batch)
        bar.update(len(batch))
    bar.close()
    writer.flush()
    return stats


def run(args: argparse.Namespace) -> None:
    device = resolve_device(args.device)
    dataset = args.dataset if args.dataset is not None else default_dataset()
    prompts = load_prompts(dataset, args.max_samples)
    out_dir: Path = args.output_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)

    tiny = args.model is None
    if tiny:
        model_dir = str(build_tiny_model(out_dir.parent / "tiny-model", args.tiny_shards))
    else:
        model_dir = args.model
        if not Path(model_dir).is_dir():
            raise UsageError(f"--model: not a local model directory: {model_dir}")

    # Check the layers against the config before spending time loading weights.
    config = text_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))
    num_layers, hidden_size = config.num_hidden_layers, config.hidden_size
    layers = args.layers if args.layers is not None else default_layers(num_layers)
    check_layers(layers, num_layers)

    log(f"Loading model {model_dir} (dtype={args.dtype}, device={device}, "
        f"transformers={transformers.__version__}, torch={torch.__version__})")
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, DTYPES[args.dtype], device)
    params = sum(p.numel() for p in model.parameters())
    log(f"Loaded model {model_dir} in {time.perf_counter() - t0:.1f}s: layers={num_layers} "
        f"hidden={hidden_size} params={params} capture layers={layers}")
    log(f"Dataset {dataset}: {len(prompts)} samples, batch_size={args.batch_size}, "
        f"max_length={args.max_length}")

    clear_previous_output(out_dir)
    writer = ShardWriter(out_dir, args.samples_per_shard)
    t1 = time.perf_counter()
    stats = extract(model, tokenizer, prompts, layers, args, device, writer)
    seconds = time.perf_counter() - t1
    tokens_per_s = stats.tokens / seconds if seconds > 0 else 0.0

    write_manifest(out_dir, {
        "model": "tiny-random-llama" if tiny else model_dir,
        "model_path": str(Path(model_dir).resolve()),
        "layers": layers,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "dtype": args.dtype,
        "device": str(device),
        "dataset": str(dataset.resolve()),
        "max_length": args.max_length,
        "samples": stats.samples,
        "tokens": stats.tokens,
        "samples_at_max_length": stats.at_max_length,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens_per_s, 2),
        "keys": "s{idx}.input_ids [seq_len] int64; s{idx}.layer{n} [seq_len, hidden_size]",
        "shards": writer.shards,
        "convention": CONVENTION,
    })
    log(f"Wrote {len(writer.shards)} shards and manifest.json to {out_dir}")
    log(f"Extraction complete: {stats.samples} samples, {stats.tokens} tokens, "
        f"{tokens_per_s:.1f} tokens/s -> {out_dir}")


def usage_exit(message: str) -> NoReturn:
    log(f"{PROG}: error: {message}")
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)  # exits 2 on bad arguments
    try:
        run(args)
    except UsageError as exc:
        usage_exit(str(exc))
    # Any other exception propagates: Python prints the traceback and exits 1.


if __name__ == "__main__":
    main()
