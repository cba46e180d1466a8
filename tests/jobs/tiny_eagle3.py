#!/usr/bin/env python3
"""Tests-only job, run with the vLLM engine env's python: a random EAGLE-3 draft for a tiny Llama (tiny_llama.py),
in the original EAGLE-3 layout vLLM's llama_eagle3 loader reads: one decoder layer whose attention takes the
embeddings and the hidden state side by side, `fc` over three captured target layers, a reduced draft vocabulary
with its d2t/t2d maps, and no embeddings of its own (it shares the target's).

    python tiny_eagle3.py TARGET_DIR DRAFT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

DRAFT_VOCAB = 128
CAPTURED = [1, 2, 3]


def main() -> None:
    target, out = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = json.loads((target / "config.json").read_text())
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    torch.manual_seed(1)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) * 0.02).to(torch.bfloat16)

    tensors = {
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "midlayer.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.hidden_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "fc.weight": w(hidden, len(CAPTURED) * hidden),
        "lm_head.weight": w(DRAFT_VOCAB, hidden),
        "d2t": torch.zeros(DRAFT_VOCAB, dtype=torch.int64),  # draft id i is target id i + d2t[i]
        "t2d": torch.arange(vocab) < DRAFT_VOCAB,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {**cfg, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
              "draft_vocab_size": DRAFT_VOCAB, "eagle_aux_hidden_state_layer_ids": CAPTURED}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    print(f"tiny EAGLE-3 draft at {out}")


if __name__ == "__main__":
    main()
