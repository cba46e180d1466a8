"""Tiny models for the real vLLM, made on the fly: no hub, a few MB, seconds to build.

Run with the engine env's python (it has torch and transformers):
    python tests/engines/tiny_models.py OUT_DIR
writes OUT_DIR/target (a random Llama in 4 safetensors shards with a byte-level tokenizer and a chat template;
one feature of every embedding is large and only token 0 reads it, so decoding always emits token 0, a plain
byte; its generation config asks for greedy decoding),
OUT_DIR/eagle3 (a random EAGLE-3 draft in the layout vLLM's llama_eagle3 loader reads: it accepts next to
nothing) and OUT_DIR/eagle3-const (a draft that always proposes token 0, so nearly every draft is accepted),
and prints their paths as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

HIDDEN, LAYERS, HEADS, KV_HEADS = 256, 4, 4, 2
DRAFT_VOCAB = 128
AUX_LAYERS = [1, 2, 3]  # the target layers whose hidden states feed the draft
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Every byte a token, the bytes first (token 0 is a plain byte), the specials after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()) + specials)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_target(out: Path) -> transformers.LlamaForCausalLM:
    tokenizer = byte_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # predictable output: one feature dominates every hidden state and picks token 0
        model.model.embed_tokens.weight[:, 0] = 1.0
        # by a logit margin of ~90, so sampling at temperature 1 (the server's default) emits token 0 too
        model.lm_head.weight[0, 0] = 20.0
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=int(size / 4 * 1.1) + 1)  # 4 shards: a bar to read
    tokenizer.save_pretrained(out)
    # greedy by default, as a served model's generation config can say: vLLM serves a request with no
    # temperature of its own (`vllm bench serve` sends none) at the model's, and at temperature 1 its
    # speculative decoding on the CPU rejects nearly every draft, even of a token the target is sure of
    generation = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0}, indent=2))
    return model


def make_eagle3(out: Path, target: transformers.LlamaForCausalLM, constant: bool = False) -> None:
    """A one-layer EAGLE-3 draft over the first DRAFT_VOCAB tokens; `constant`: its final norm is zero, so
    its logits tie and it proposes draft id 0 (token 0) every time."""
    config = target.config.to_dict()
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=DRAFT_VOCAB,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": AUX_LAYERS, "use_aux_hidden_state": True})
    config.pop("_name_or_path", None)
    h, kv_dim = HIDDEN, KV_HEADS * (HIDDEN // HEADS)
    g = torch.Generator().manual_seed(2)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    d2t = torch.zeros(DRAFT_VOCAB, dtype=torch.int64)  # draft id i -> target id i + d2t[i]
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    t2d[:DRAFT_VOCAB] = True

    def ones() -> torch.Tensor:  # safetensors refuses tensors that share memory
        return torch.ones(h, dtype=torch.bfloat16)

    weights = {
        "midlayer.self_attn.q_proj.weight": rand(h, 2 * h), "midlayer.self_attn.k_proj.weight": rand(kv_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv_dim, 2 * h), "midlayer.self_attn.o_proj.weight": rand(h, h),
        "midlayer.input_layernorm.weight": ones(), "midlayer.hidden_norm.weight": ones(),
        "midlayer.post_attention_layernorm.weight": ones(),
        "midlayer.mlp.gate_proj.weight": rand(2 * h, h), "midlayer.mlp.up_proj.weight": rand(2 * h, h),
        "midlayer.mlp.down_proj.weight": rand(h, 2 * h),
        "norm.weight": ones() * (0 if constant else 1), "fc.weight": rand(h, len(AUX_LAYERS) * h), "lm_head.weight": rand(DRAFT_VOCAB, h),
        "d2t": d2t, "t2d": t2d,
    }
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))


def main(root: Path) -> None:
    target = make_target(root / "target")
    make_eagle3(root / "eagle3", target)
    make_eagle3(root / "eagle3-const", target, constant=True)
    print(json.dumps({"target": str(root / "target"), "eagle3": str(root / "eagle3"),
                      "eagle3_const": str(root / "eagle3-const")}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
