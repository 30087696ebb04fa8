"""How a projection runs on the kernel path (engine.model.decoder_layer's use_kernels), and how two or three of them
become one: the choice between the skinny GEMV, cuBLAS and an Fp8Linear's own matmul by the step's rows, the gated
GEMV that gives an MLP's silu(gate) * up straight from its fused gate/up projection, and the fusion of q/k/v or
gate/up.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.fp8_linear import GEMV_ROWS, Fp8Linear, Fp8Rows, fuse_fp8

SKINNY_ROWS = 2  # kernel path: steps of at most this many tokens use engine.kernels.skinny_gemm (see kernel_linear)


def kernel_linear(layer: nn.Linear | Fp8Linear, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
    """layer(x) on the kernel path: the skinny GEMV for a few rows (one pass over the weight), cuBLAS otherwise
    (an Fp8Linear always runs its own FP8 matmul)."""
    if x.shape[0] <= SKINNY_ROWS and type(layer) is nn.Linear:
        from engine.kernels.skinny_gemm import skinny_linear
        return skinny_linear(x, layer.weight, layer.bias)
    return layer(x)


def gated_linear(gate_up: nn.Linear | Fp8Linear | None, x: torch.Tensor | Fp8Rows) -> torch.Tensor | None:
    """silu(gate) * up [T, I] from a fused [gate; up] projection's GEMV (its epilogue: no SiLU-and-mul launch,
    rounded as that kernel rounds) where the step's rows run one: the skinny GEMV (bf16) or the weight-only e4m3
    GEMV (FP8). None where they do not (the caller runs the projection and the activation apart)."""
    if type(gate_up) is nn.Linear and x.shape[0] <= SKINNY_ROWS:
        from engine.kernels.skinny_gemm import skinny_linear
        return skinny_linear(x, gate_up.weight, gate_up.bias, gated=True)
    if isinstance(gate_up, Fp8Linear) and not isinstance(x, Fp8Rows) and x.shape[0] <= GEMV_ROWS:
        return gate_up.gated(x)
    return None


def fuse_linears(*linears: nn.Linear | Fp8Linear) -> nn.Linear | Fp8Linear:
    """One Linear whose output is the concatenation of the given ones' outputs (same input); FP8 ones stay FP8."""
    fp8 = [isinstance(lin, Fp8Linear) for lin in linears]
    if any(fp8):
        if not all(fp8):
            raise ValueError("the FP8 quantization config quantizes some of the projections fused into one "
                             "(q/k/v or gate/up) and ignores others; quantize all of them or none")
        return fuse_fp8(*linears)
    weight = torch.cat([lin.weight.data for lin in linears])  # [sum of outs, in]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=linears[0].bias is not None,
                      device=weight.device, dtype=weight.dtype)
    fused.weight.data = weight
    if fused.bias is not None:
        fused.bias.data = torch.cat([lin.bias.data for lin in linears])
    return fused
