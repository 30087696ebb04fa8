"""Rotary position embeddings: the cos/sin table (with Llama 3.1 frequency scaling) and its application.

Computed in float32 exactly as transformers does (inv_freq from an int64 arange, positions times inv_freq,
duplicated halves), then cast to the activations' dtype, so our q/k match theirs bit for bit.
"""

from __future__ import annotations

import math

import torch

from engine.model.model_config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] float32 rotation frequencies."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables [max_positions, head_dim] (float32, non-persistent buffers). `build()` (re)computes them,
    e.g. after the model was created on the meta device and moved with `to_empty`."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if self.cos.device.type != "meta":
            self.build(self.cos.device)

    def build(self, device: torch.device | str) -> None:
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, D] in `dtype`, ready to broadcast over heads."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D]; k [T, KVH, D]; cos, sin [T, 1, D] -> rotated (q, k)."""
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos, sin [T, 1, D] -> x rotated (every head by its token's angle)."""
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
