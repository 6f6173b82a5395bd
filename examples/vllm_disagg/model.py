"""A tiny Llama written to a local folder: a config and seeded random weights (safetensors), nothing
downloaded. Prompts are token ids (the engines run with skip_tokenizer_init), so no tokenizer is needed.

The weights are drawn with a large spread (std 0.3 rather than vLLM's near-zero dummy weights), so the
next token depends on every position's keys and values: decoding from the wrong KV gives other tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)
STD = 0.3


def write(folder: Path, seed: int = 1234) -> Path:
    """Writes config.json and model.safetensors into `folder` unless the same shape and seed are there."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    stamp = folder / "tether-model.json"
    want = {"shape": SHAPE, "seed": seed, "std": STD}
    if stamp.is_file() and json.loads(stamp.read_text()) == want and (folder / "model.safetensors").is_file():
        return folder
    cfg = dict(SHAPE, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32",
               bos_token_id=1, eos_token_id=2, initializer_range=STD)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    g = torch.Generator().manual_seed(seed)
    h, inter, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    hd = h // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * hd

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * STD).contiguous()

    w = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": torch.ones(h), "lm_head.weight": rnd(v, h)}
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(h, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                  p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, h),
                  p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                  p + "mlp.down_proj.weight": rnd(h, inter),
                  p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)})
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    stamp.write_text(json.dumps(want))
    return folder
