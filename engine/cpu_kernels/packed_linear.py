"""Linear layers with their weights packed ahead of time by oneDNN for this CPU (the torch path's 16-bit layers).

Owns the choice (`packs(dtype)`) and the swap (`pack_linears(model)`). A bfloat16 `nn.Linear` on the CPU goes through
oneDNN, which reorders the weight into its blocked layout on every call; for the few rows of a decode step that
reorder is most of the call (tiny, 16 rows: the five projections of a layer and the head, 241 -> 121 us). Packing
once at load time skips it; the results are the same bits (the same oneDNN kernel runs). float32 layers stay on MKL's
GEMM: packing them gained little there and changed the low bits of some sums. The packed layer keeps no plain
weight, so nothing else may read `.weight` of a swapped layer: the GPU path's kernels and tensor parallelism do, and
neither runs here (`pack_linears` is called only for TP=1 on the torch path).
"""

from __future__ import annotations

import torch
from torch import nn

ROWS_HINT = 16  # oneDNN picks its blocking for about this many rows; a decode step's batch (prefill is not slower)


def packs(dtype: torch.dtype) -> bool:
    """Whether this torch can pack `dtype` linears here (oneDNN present, a 16-bit dtype it runs on this CPU)."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise") and \
        torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """`linear(x)` with a weight oneDNN packed once; x [T, in] -> [T, out] in the layer's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Parameters (frozen), so whatever counts the model's weights (parameters()) still sees them all
        self.packed = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT),
                                   requires_grad=False)  # [out, in], oneDNN's opaque layout
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swap every `nn.Linear` below `model` (fused projections, the LM head) for a PackedLinear; how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
