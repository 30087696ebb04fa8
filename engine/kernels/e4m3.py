"""e4m3 inside Triton kernels: rounding float32 values to float8 e4m3 the way torch's cast does (`to_e4m3`), and
widening packed e4m3 words to float16 (`widen_e4m3_words`, for the fp8 cache's V in engine.kernels.decode_attention).

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


@triton.jit
def _e4m3x4_to_f16(words):
    # one int32 word = 4 e4m3 values (little-endian: byte i is value i) -> four float16 tensors, one per byte
    return tl.inline_asm_elementwise(
        asm="""{ .reg .b16 lo, hi; .reg .b32 a, b;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mov.b32 {$0, $1}, a;
        mov.b32 {$2, $3}, b; }""",
        constraints="=h,=h,=h,=h,r", args=[words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True, pack=1)


@triton.jit
def _e4m3x4_to_f16_portable(words):
    # the same as _e4m3x4_to_f16 in plain Triton, for the CPU interpreter (which cannot run inline PTX)
    return ((words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16),
            ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16),
            ((words >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16),
            ((words >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16))


@triton.jit
def widen_e4m3_words(words, ROWS: tl.constexpr, COLS: tl.constexpr, PTX: tl.constexpr):
    """[ROWS, COLS // 4] int32 words of packed e4m3 -> [ROWS, COLS] float16 in registers: with PTX (sm_89+) by
    cvt.rn.f16x2.e4m3x2, otherwise (the CPU interpreter) by shifts and casts. Why: a tile that tl.dot reduces along
    its rows (P.V's V) is transposed on its way to the tensor cores. Loaded as e4m3, the compiler widens it after
    that transpose and reads shared memory a byte at a time (sm_90 build of the decode kernel: 128 LDS.U8 and 1,061
    instructions a loop iteration); widened here first, the float16 tile transposes through ldmatrix (704)."""
    if PTX:
        v0, v1, v2, v3 = _e4m3x4_to_f16(words)
    else:
        v0, v1, v2, v3 = _e4m3x4_to_f16_portable(words)
    return tl.reshape(tl.join(tl.join(v0, v2), tl.join(v1, v3)), (ROWS, COLS))
