"""Write a random-weight Hugging Face checkpoint of a real model's shape, for benchmarks on a lent GPU, and FP8
checkpoints in the compressed-tensors layout, for tests and benchmarks. Every big-shape figure of docs/benchmarks.md
runs on one of its checkpoints (`bash benchmarks/gpu_run.sh` writes them first); tests import its functions.

`python benchmarks/make_random_checkpoint.py llama-3.2-1b /tmp/l1b --device cuda`
Weights are N(0, 0.02) in bfloat16 (norms 1). The tokenizer is synthesized for exactly the model's vocabulary
(benchmarks/vocab_tokenizer.py: Llama 3's byte-level layout, every id decodes to text), and config.json's bos/eos ids
are its. Only shapes matter for speed; no weights can be downloaded here. Tensors are written in shards of at most
`SHARD_BYTES` (with model.safetensors.index.json) as they are drawn, so memory holds one shard, not the model.
`--fp8 tensor|channel` writes the decoder's linears as FP8 in the compressed-tensors layout (e4m3 weights, float32
scales per tensor or per output channel, dynamic per-token activations; embedding, norms and lm_head stay bfloat16),
as an FP8 checkpoint such as RedHatAI's Llama-3.1-8B-Instruct-FP8 is. `--layers N` keeps the preset's shape with N
decoder layers: a 70B layer's kernels timed on a card the whole 70B does not fit.

FP8 (what llm-compressor's FP8_DYNAMIC scheme stores and vLLM reads): `quantize_weight(w, strategy)` -> (e4m3 weight,
scale) with w ~= weight * scale (round to nearest e4m3 of w / scale); `quantization_config(strategy)` is the
`config.json` entry; `quantize_folder(src, dst, strategy)` rewrites a whole 16-bit checkpoint folder (config,
generation config, tokenizer files copied; weights quantized). (Until f1a5769 these were benchmarks/fp8_checkpoint.py.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.vocab_tokenizer import write_tokenizer  # noqa: E402

LLAMA3_VOCAB = 128256
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=LLAMA3_VOCAB, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=LLAMA3_VOCAB, tie_word_embeddings=False),
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=LLAMA3_VOCAB, tie_word_embeddings=False),
    # Llama 3's vocabulary on a CPU-sized body: the tokenizer and sampling paths at full width, cheap layers.
    "small-128k": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=LLAMA3_VOCAB, tie_word_embeddings=False),
}
SHARD_BYTES = 5 << 30
DTYPE_BYTES = 2  # bfloat16
FP8_MAX = 448.0
STRATEGIES = ("tensor", "channel")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def preset_shape(preset: str, layers: int | None = None) -> dict[str, Any]:
    """PRESETS[preset], with `layers` decoder layers instead of its own when given (a ValueError if not positive)."""
    if layers is None:
        return dict(PRESETS[preset])
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    return {**PRESETS[preset], "num_hidden_layers": layers}


def quantization_config(strategy: str) -> dict[str, Any]:
    """config.json's `quantization_config` for FP8 weights (scales per `strategy`) and dynamic per-token inputs."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {**fp8, "strategy": strategy, "dynamic": False},
                                          "input_activations": {**fp8, "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def is_quantized(name: str) -> bool:
    """Whether the checkpoint tensor `name` is a decoder linear's weight (quantized; lm_head is not)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEARS


def quantize_weight(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 [out, in], float32 scale [1] ("tensor") or [out, 1] ("channel")): the largest
    magnitude maps to 448."""
    wf = w.float()
    amax = wf.abs().amax() if strategy == "tensor" else wf.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(1e-12).reshape(1 if strategy == "tensor" else (-1, 1))
    return (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.float()


def quantize_folder(src: Path, dst: Path, strategy: str) -> Path:
    """Write `src` (a 16-bit safetensors checkpoint) to `dst` as an FP8 compressed-tensors checkpoint."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model") and f.name != "config.json":
            shutil.copyfile(f, dst / f.name)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = quantization_config(strategy)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    out: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensor = f.get_tensor(name)
                if is_quantized(name):
                    out[name], out[name.removesuffix("weight") + "weight_scale"] = quantize_weight(tensor, strategy)
                else:
                    out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def tensor_shapes(shape: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of the Llama checkpoint under its Hugging Face name, in file order."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = shape.get("head_dim", h // shape["num_attention_heads"])
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield from ((p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                    (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                    (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                    (p + "post_attention_layernorm.weight", (h,)))
    yield "model.norm.weight", (h,)
    if not shape["tie_word_embeddings"]:
        yield "lm_head.weight", (vocab, h)


def plan_shards(shape: dict[str, Any], shard_bytes: int = SHARD_BYTES,
                fp8: str | None = None) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Tensors grouped in file order into shards of at most `shard_bytes` (a larger tensor gets a shard alone);
    with `fp8`, the quantized linears count one byte per value."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dims in tensor_shapes(shape):
        nbytes = (1 if fp8 and is_quantized(name) else DTYPE_BYTES) * torch.Size(dims).numel()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, dims))
        size += nbytes
    return shards


def write_checkpoint(folder: Path, shape: dict[str, Any], device: str = "cpu", seed: int = 0,
                     shard_bytes: int = SHARD_BYTES, weights: bool = True, fp8: str | None = None) -> None:
    """config.json, generation_config.json, tokenizer files and (`weights`) safetensors weights of `shape` into
    `folder`. Without weights the folder serves only with `load_format: dummy` (random weights drawn in place).
    `fp8` ("tensor" or "channel"): the linears as FP8 compressed-tensors with scales of that strategy (with
    `weights` False only the config says so: `load_format: dummy` then draws FP8 weights in place)."""
    if fp8 is not None and fp8 not in STRATEGIES:
        raise ValueError(f"fp8 must be one of {STRATEGIES}, got {fp8!r}")
    folder.mkdir(parents=True, exist_ok=True)
    stale = sorted(f.name for f in folder.glob("model*.safetensors*"))
    if stale:  # a leftover index or shard would be loaded with (or instead of) the new weights
        raise FileExistsError(f"{folder} already holds weights ({', '.join(stale)}); remove them or pick a new folder")
    ids = write_tokenizer(folder, shape["vocab_size"])
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
              "torch_dtype": "bfloat16", "bos_token_id": ids.bos, "eos_token_id": ids.eos_ids, **shape}
    if fp8 is not None:
        config["quantization_config"] = quantization_config(fp8)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids.bos, "eos_token_id": ids.eos_ids}, indent=2) + "\n")
    if not weights:
        return
    gen = torch.Generator(device=device).manual_seed(seed)
    shards = plan_shards(shape, shard_bytes, fp8)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for file, tensors in zip(names, shards, strict=True):
        drawn = {}
        for name, dims in tensors:
            if len(dims) == 1:
                drawn[name] = torch.ones(dims, dtype=torch.bfloat16)
            else:
                drawn[name] = (torch.randn(dims, generator=gen, device=device) * 0.02).to(torch.bfloat16)
            if fp8 is not None and is_quantized(name):
                scale_name = name.removesuffix("weight") + "weight_scale"
                drawn[name], drawn[scale_name] = quantize_weight(drawn[name], fp8)
                weight_map[scale_name] = file
            weight_map[name] = file
        drawn = {name: t.cpu() for name, t in drawn.items()}
        total += sum(t.numel() * t.element_size() for t in drawn.values())
        save_file(drawn, str(folder / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Sizes in bfloat16 on disk: llama-3.2-1b ~2.5 GB, llama-3-8b ~16 GB, llama-3-70b ~141 GB (needs that "
               "much free disk; memory holds one 5 GB shard), small-128k ~0.14 GB (runs on a CPU).")
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("folder", type=Path)
    parser.add_argument("--device", default="cpu", help="where to draw the weights (cuda is much faster)")
    parser.add_argument("--fp8", choices=STRATEGIES, default=None,
                        help="FP8 linears (compressed-tensors) with per-tensor or per-channel weight scales")
    parser.add_argument("--no-weights", action="store_true",
                        help="config and tokenizer only, for load_format: dummy (a 70B shape without 141 GB of disk)")
    parser.add_argument("--layers", type=int, default=None,
                        help="this many decoder layers instead of the preset's: a big shape's per-layer kernels on a "
                             "card its whole depth does not fit (e.g. llama-3-70b's layers on an 80 GB GPU)")
    args = parser.parse_args()
    try:
        shape = preset_shape(args.preset, args.layers)
        write_checkpoint(args.folder, shape, args.device, weights=not args.no_weights, fp8=args.fp8)
    except (ValueError, FileExistsError) as e:
        parser.error(str(e))
    print(f"wrote {args.preset} ({shape['num_hidden_layers']} layers) to {args.folder}")


if __name__ == "__main__":
    main()
