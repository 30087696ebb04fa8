"""engine.kernels.skinny_gemm (the decode projections' GEMV) against a float64 torch reference.

On the CPU it runs in Triton's interpreter at small shapes (N and K not multiples of the tiles, 1-16 rows, bias);
with a GPU the same checks repeat at Llama-3-8B projection sizes. Outputs are poisoned
with NaN so unwritten elements fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.skinny_gemm import skinny_linear

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output (an element was not written)"
    return ((out.double() - ref).norm() / ref.norm()).item()


def randn(shape, dtype, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(DEV)


def check_linear(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = randn((m, k), dtype, g)
    w = randn((n, k), dtype, g) * k ** -0.5
    b = randn((n,), dtype, g) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)

    got = skinny_linear(x, w, b, out=out)

    assert got is out
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("m,n,k,dtype,bias", [
    pytest.param(1, 37, 70, torch.float32, False, id="m1-fp32-ragged"),
    pytest.param(2, 64, 96, torch.bfloat16, True, id="m2-bf16-bias"),
    pytest.param(3, 21, 45, torch.float16, False, id="m3-fp16-ragged"),
    pytest.param(16, 16, 64, torch.bfloat16, True, id="m16-bf16-bias"),
    pytest.param(1, 40, 33, torch.bfloat16, False, id="m1-bf16"),
])
def test_skinny_linear_matches_reference(m, n, k, dtype, bias):
    check_linear(m, n, k, dtype, bias, seed=m * 1000 + n + k)


@pytest.mark.parametrize("m,i,k,dtype,bias", [
    pytest.param(1, 37, 70, torch.bfloat16, False, id="m1-bf16-ragged"),
    pytest.param(2, 40, 96, torch.bfloat16, True, id="m2-bf16-bias"),
    pytest.param(3, 21, 45, torch.float32, False, id="m3-fp32"),
])
def test_gated_skinny_linear_is_the_gemv_then_silu_and_mul(m, i, k, dtype, bias):
    """A fused [gate; up] weight's gated GEMV: silu(gate) * up as engine.kernels.silu_mul makes it of the plain
    GEMV's output, bit for bit (the same sums, each rounded to the dtype before the activation as there)."""
    from engine.kernels.silu_mul import silu_and_mul
    g = torch.Generator().manual_seed(m + i + k)
    x = randn((m, k), dtype, g)
    w = randn((2 * i, k), dtype, g) * k ** -0.5
    b = randn((2 * i,), dtype, g) if bias else None
    out = torch.full((m, i), float("nan"), dtype=dtype, device=DEV)
    got = skinny_linear(x, w, b, out=out, gated=True)
    assert got is out and not torch.isnan(got).any()
    assert torch.equal(got, silu_and_mul(skinny_linear(x, w, b)))
    with pytest.raises(ValueError, match="even"):
        skinny_linear(x, w[:-1], gated=True)
    with pytest.raises(ValueError, match=rf"out must be \[{m}, {i}\]"):
        skinny_linear(x, w, gated=True, out=torch.zeros(m, 2 * i, dtype=dtype, device=DEV))


def test_skinny_linear_zero_rows_and_strided_input():
    g = torch.Generator().manual_seed(4)
    w = randn((12, 20), torch.float32, g)
    assert skinny_linear(torch.zeros(0, 20, device=DEV), w).shape == (0, 12)
    x = randn((3, 40), torch.float32, g)[:, :20]  # a view with row stride 40
    assert rel_err(skinny_linear(x, w), x.double() @ w.double().T) < 1e-5


def _args():
    return dict(x=torch.zeros(2, 8, device=DEV), weight=torch.zeros(4, 8, device=DEV))


@pytest.mark.parametrize("name,bad", [
    ("x", lambda a: {"x": a["x"][0]}),
    ("x", lambda a: {"x": torch.zeros(17, 8, device=DEV)}),
    ("x", lambda a: {"x": torch.zeros(2, 9, device=DEV)}),
    ("weight", lambda a: {"weight": a["weight"].double()}),
    ("weight", lambda a: {"weight": torch.zeros(8, 4, device=DEV).T}),
    ("bias", lambda a: {"bias": torch.zeros(5, device=DEV)}),
    ("out", lambda a: {"out": torch.zeros(2, 5, device=DEV)}),
])
def test_skinny_linear_rejects_bad_arguments(name, bad):
    args = _args()
    args.update(bad(args))
    with pytest.raises(ValueError, match=rf"^{name} "):
        skinny_linear(**args)


@pytest.mark.skipif(not CUDA, reason="real sizes need a CUDA device")
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],
                         ids=["qkv", "o_proj", "gate_up", "down"])
def test_skinny_linear_llama_8b_sizes(m, n, k):
    g = torch.Generator().manual_seed(m + n)
    x = randn((m, k), torch.bfloat16, g)
    w = randn((n, k), torch.bfloat16, g) * k ** -0.5
    out = skinny_linear(x, w, out=torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV))
    assert rel_err(out, x.double() @ w.double().T) < 1e-2
    assert rel_err(out, F.linear(x, w).double()) < 1e-2  # and cuBLAS agrees
    if n == 28672 and m <= 2:  # gate_up, as the model runs it at these rows: SiLU-and-mul in the epilogue
        from engine.kernels.silu_mul import silu_and_mul
        assert torch.equal(skinny_linear(x, w, gated=True), silu_and_mul(out))
