#!/usr/bin/env python3
"""Tests-only job, run with the vLLM engine env's python: a tiny random Llama vLLM's CPU build serves, made on
the spot (no hub): 4 layers, hidden 256, 4 heads / 2 KV heads, bf16, 4 safetensors shards, the byte-level
tokenizer orch's own extraction job builds, and a chat template (prepare-data renders conversations).

    python tiny_llama.py DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "playbooks" / "jobs"))
from extract_hidden_states import build_tiny_tokenizer  # orch's own job script

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def main() -> None:
    out = Path(sys.argv[1])
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=int(total / 4 * 1.1) + 1)
    tokenizer.save_pretrained(out)
    print(f"tiny llama at {out}: {len(list(out.glob('*.safetensors')))} shards")


if __name__ == "__main__":
    main()
