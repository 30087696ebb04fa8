"""Rounding float32 values to float8 e4m3 inside a Triton kernel, the same way torch's cast does.

Shared by every kernel that writes e4m3: the KV-cache stores (engine.kernels.kv_store) and the activation
quantization of FP8 linears (engine.kernels.fp8_quant). e4m3 (float8_e4m3fn) has no infinity; its largest finite
value is 448, and torch's cast of a larger magnitude gives NaN, so values are clamped first.

The rounding is done in float32 before the cast, so the cast itself is exact: Triton's interpreter rounds fp8
casts wrongly (Triton 3.9: a carry out of the mantissa is dropped, 1.9375 -> 1.0), and CPU CI tests these kernels
there. An e4m3 value of binade 2^E has 3 mantissa bits, so its spacing is 2^(E-3), and 2^-9 below the smallest
normal 2^-6 (biased float32 exponent 121); adding and subtracting 1.5 * 2^23 spacings rounds to a multiple of the
spacing, ties to even, in float32's own round-to-nearest-even (on the magnitude; the sign bit is put back).
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # a jitted kernel may read only constexpr globals


@triton.jit
def to_e4m3(y):
    # y: float32 values already divided by their scale -> e4m3, clamped to +-448, rounded to nearest even
    bits = y.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(y), FP8_MAX)
    biased = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    spacing = ((tl.maximum(biased, 121) - 3) << 23).to(tl.float32, bitcast=True)
    magic = spacing * 12582912.0  # 1.5 * 2^23
    a = (a + magic) - magic
    # the sign put back by its bit: a value that rounds to zero keeps it (-0.0, as torch's cast gives)
    return (a.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True).to(tl.float8e4nv)
