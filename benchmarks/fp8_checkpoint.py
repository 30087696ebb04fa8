"""Write FP8 checkpoints in the compressed-tensors layout (what llm-compressor's FP8_DYNAMIC scheme stores and vLLM
reads), for tests and benchmarks: the decoder's linears as float8_e4m3fn with float32 scales per tensor or per
output channel, activations declared dynamic per token, `lm_head` left in the checkpoint's dtype.

`quantize_weight(w, strategy)` -> (e4m3 weight, scale) with w ~= weight * scale (round to nearest e4m3 of w / scale);
`quantization_config(strategy)` is the `config.json` entry; `quantize_folder(src, dst, strategy)` rewrites a whole
16-bit checkpoint folder (config, generation config, tokenizer files copied; weights quantized).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0
STRATEGIES = ("tensor", "channel")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
