"""Write a random-weight Hugging Face checkpoint of a real model's shape, for benchmarks on a lent GPU.

`python benchmarks/make_random_checkpoint.py llama-3.2-1b /tmp/llama1b --device cuda`
Weights are N(0, 0.02) in bfloat16 (norms 1); the tokenizer files are the tiny model's (its ids are a subset of
the vocabulary). Only shapes matter for speed; no weights can be downloaded here.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.tiny import ensure_tiny_model

PRESETS = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    shape = PRESETS[args.preset]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, **shape}
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    kvd = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    gen = torch.Generator(device=args.device).manual_seed(0)

    def rand(*s):
        return (torch.randn(*s, generator=gen, device=args.device) * 0.02).to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": rand(shape["vocab_size"], h), "model.norm.weight": torch.ones(h)}
    if not shape["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(shape["vocab_size"], h)
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kvd, h),
                    p + "self_attn.v_proj.weight": rand(kvd, h), p + "self_attn.o_proj.weight": rand(h, h),
                    p + "mlp.gate_proj.weight": rand(shape["intermediate_size"], h),
                    p + "mlp.up_proj.weight": rand(shape["intermediate_size"], h),
                    p + "mlp.down_proj.weight": rand(h, shape["intermediate_size"]),
                    p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)}
    args.folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, args.folder / "model.safetensors")
    (args.folder / "config.json").write_text(json.dumps(config, indent=2))
    tiny = ensure_tiny_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny / name, args.folder / name)
    print(f"wrote {args.preset} to {args.folder}")


if __name__ == "__main__":
    main()
