"""engine.kernels.fp8_mm_swiglu (the FP8 tensor-core gate/up projection with SwiGLU in its epilogue, then the
quantization for down_proj) against the launches it replaces, fp8_mm then silu_mul_quant: the same e4m3 bytes and
scales, per row and with a static input scale, with a bias, split K, and an intermediate size that is not a multiple
of the tile. On the CPU in Triton's interpreter at small shapes; with a GPU at Llama-3-8B's sizes."""

from __future__ import annotations

import pytest
import torch

from benchmarks.make_random_checkpoint import quantize_weight
from engine.kernels.fp8_gemm import fp8_mm
from engine.kernels.fp8_mm_swiglu import fp8_mm_swiglu_quant
from engine.kernels.fp8_quant import silu_mul_quant
from engine.model.fp8_linear import FP8
from engine.model.fp8_linear import quantize_rows as torch_quantize_rows

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER = (4096, 14336) if DEVICE == "cuda" else (96, 40)  # 40: not a multiple of the interpreter's 8 pairs
SPLIT_LAUNCH = (16, 16, 32, 4, 1) if DEVICE == "cpu" else (64, 64, 256, 4, 4)  # + SPLIT_K


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def operands(m: int, seed: int, bias: bool) -> dict:
    xq, xs = torch_quantize_rows(rand(m, HIDDEN, seed=seed), None)
    wq, ws = quantize_weight(rand(2 * INTER, HIDDEN, seed=seed + 1, dtype=torch.float32, scale=0.05), "channel")
    return dict(x=xq, x_scales=xs, weight=wq, w_scales=ws.reshape(1, -1).contiguous(),
                bias=rand(2 * INTER, seed=seed + 2) if bias else None)


def unfused(args: dict, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = fp8_mm(args["x"], args["x_scales"], args["weight"], args["w_scales"], args["bias"])
    return silu_mul_quant(gate_up, input_scale)


def agree(fused: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Equal bits on the CPU. On a GPU the MMA sums a pair's rows in other tile positions: gate_up may differ by one
    bfloat16 rounding here and there, so h by about as much and its e4m3 by at most one step (2^-3 relative)."""
    (q, s), (rq, rs) = fused, ref
    assert q.dtype == FP8 and q.shape == rq.shape and s.shape == rs.shape
    if DEVICE == "cpu":
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    else:
        assert ((s - rs).abs() / rs).max().item() <= 2 ** -7
        values, ref_values = q.float() * s, rq.float() * rs
        assert ((values - ref_values).abs().max() / ref_values.abs().max()).item() <= 2 ** -3


@pytest.mark.parametrize("m,bias,static", [
    pytest.param(2, False, False, id="m2"),
    pytest.param(5, True, False, id="m5-bias"),
    pytest.param(16, False, True, id="m16-static-scale"),
    pytest.param(33, True, False, id="m33-two-token-tiles"),
])
def test_fused_gate_up_is_fp8_mm_then_silu_mul_quant(m, bias, static):
    args = operands(m, seed=m, bias=bias)
    input_scale = torch.tensor([0.02], device=DEVICE) if static else None
    agree(fp8_mm_swiglu_quant(**args, input_scale=input_scale), unfused(args, input_scale))


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_meets_on_the_callers_semaphores_and_leaves_them_zero(split_k):
    args = operands(16, seed=80 + split_k, bias=True)
    whole = fp8_mm_swiglu_quant(**args, config=(*SPLIT_LAUNCH, 1))
    sems = torch.zeros(4096, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        split = fp8_mm_swiglu_quant(**args, config=(*SPLIT_LAUNCH, split_k), semaphores=sems)
        # float32 partial sums added in another order: h within a bf16 rounding, e4m3 within a step
        assert ((split[1] - whole[1]).abs() / whole[1]).max().item() <= 2 ** -7
        diff = (split[0].float() * split[1] - whole[0].float() * whole[1]).abs().max()
        assert (diff / (whole[0].float() * whole[1]).abs().max()).item() <= 2 ** -3
        assert not sems.any()


def test_refuses_what_it_cannot_take():
    args = operands(2, seed=9, bias=False)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_mm_swiglu_quant(**(args | {"x": args["x"].to(torch.bfloat16), "x_scales": None}))
    with pytest.raises(ValueError, match="even"):
        fp8_mm_swiglu_quant(**args, config=(15, 16, 32, 4, 1, 1))
    with pytest.raises(ValueError, match="input_scale"):
        fp8_mm_swiglu_quant(**args, input_scale=torch.ones(2, device=DEVICE))
