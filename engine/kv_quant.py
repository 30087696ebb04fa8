"""The FP8 KV cache: the `kv_cache_dtype` setting, the dtype a cache stores, and the per-layer K/V scales.

With `kv_cache_dtype: fp8` a cache stores float8_e4m3fn: each new key k is written as k / k_scale and each value
as v / v_scale, clamped to +-448 (e4m3's largest finite value) and rounded to nearest. Scales are per tensor: one
k_scale and one v_scale per layer, the same for every head and token. Readers do not dequantize a tensor: they
fold the scales, scores = (q . k8) * (softmax_scale * k_scale) and out = v_scale * (softmax(scores) @ v8), which
is the same mathematics as attending over k8 * k_scale and v8 * v_scale.

Scales come from the checkpoint where it has them (`model.layers.N.self_attn.k_scale` / `v_scale`, the older single
`kv_scale`, or ModelOpt's `self_attn.k_proj.k_scale` / `v_proj.v_scale`), else 1.0, as vLLM uses without calibrated
scales: fine for models whose K/V stay well inside +-448 (Llama-family activations do).

Torch-free except `quantize` / `dequantize` (the torch path's reference numerics).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_DTYPE = "float8_e4m3fn"  # KVCacheSpec.dtype of an fp8 cache
FP8_MAX = 448.0
_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?(k_scale|v_scale|kv_scale)$")


def check_kv_cache_dtype(value: object, key: str = "kv_cache_dtype") -> None:
    """ValueError naming `key` unless `value` is one of KV_CACHE_DTYPES."""
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"{key} must be one of {KV_CACHE_DTYPES} ('auto': the model's dtype; 'fp8' = 'fp8_e4m3': "
                         f"float8 e4m3 with per-layer scales), got {value!r}")


def cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype name a cache stores (a KVCacheSpec.dtype): the model's for "auto", FP8_DTYPE for fp8."""
    check_kv_cache_dtype(kv_cache_dtype)
    return model_dtype if kv_cache_dtype == "auto" else FP8_DTYPE


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor name is a KV-cache scale (read by load_kv_scales, not a model weight)."""
    return _SCALE_NAME.search(name) is not None


@dataclass(frozen=True)
class KVScales:
    """One k_scale and one v_scale per layer (per tensor)."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"KVScales: {len(self.k)} k scales but {len(self.v)} v scales")
        for name, values in (("k_scale", self.k), ("v_scale", self.v)):
            for i, s in enumerate(values):
                if not (isinstance(s, float) and math.isfinite(s) and s > 0):
                    raise ValueError(f"layer {i}'s {name} must be a finite positive number, got {s!r}")

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    def digest(self) -> str:
        """A short fingerprint: caches whose scales differ cannot exchange blocks (KVCacheSpec.kv_scales)."""
        text = ",".join(f"{k!r}/{v!r}" for k, v in zip(self.k, self.v, strict=True))
        return hashlib.sha1(text.encode()).hexdigest()[:12]


def load_kv_scales(folder: str | Path | None, num_layers: int) -> KVScales:
    """The checkpoint's per-layer K/V scales in `folder` (its *.safetensors files), 1.0 where it has none; `folder`
    None (dummy weights): all 1.0. ValueError naming the tensor for a scale that is not one positive number."""
    k, v = [1.0] * num_layers, [1.0] * num_layers
    if folder is None:
        return KVScales(tuple(k), tuple(v))
    from safetensors import safe_open
    for path in sorted(Path(folder).glob("*.safetensors")):  # (not weights.checkpoint_files: it imports this module)
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                match = _SCALE_NAME.search(name)
                if match is None:
                    continue
                layer, which = int(match.group(1)), match.group(2)
                t = f.get_tensor(name)
                if layer >= num_layers or t.numel() != 1:
                    raise ValueError(f"{path}: KV scale {name!r} must be one number of a layer < {num_layers}, got "
                                     f"shape {tuple(t.shape)}")
                value = float(t.float().item())
                if not (math.isfinite(value) and value > 0):
                    raise ValueError(f"{path}: KV scale {name!r} must be finite and positive, got {value}")
                if which in ("k_scale", "kv_scale"):
                    k[layer] = value
                if which in ("v_scale", "kv_scale"):
                    v[layer] = value
    return KVScales(tuple(k), tuple(v))


def quantize(x, scale: float):
    """x (any float dtype) -> float8_e4m3fn of x / scale, clamped to +-FP8_MAX (torch's cast would give NaN)."""
    import torch
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize(x8, scale: float, dtype):
    """float8_e4m3fn x8 -> x8 * scale in `dtype` (computed in float32)."""
    return (x8.float() * scale).to(dtype)
