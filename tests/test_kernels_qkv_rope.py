"""engine.kernels.qkv_rope (the decode qkv projection with RoPE and the KV store fused in) against references:
float64 math for the projection and the rotation, and the cache written exactly at the live slots and nowhere
else. On the CPU in Triton's interpreter at small shapes; with a GPU also at Llama-3-8B size."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.qkv_rope import qkv_rope_store
from engine.kernels.rope import rope_and_store
from engine.kernels.skinny_gemm import skinny_linear
from tests.test_kernels_elementwise import (
    CUDA,
    DEV,
    TOL,
    bits,
    gen,
    randn,
    random_slots,
    reference_store,
    rel_err,
    rope_reference,
    rope_tables,
)

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)


def run_case(m: int, h: int, kvh: int, d: int, hidden: int, dtype: torch.dtype, bias: bool, bs: int,
             n_pad: int, seed: int) -> None:
    g = gen(seed)
    nb, layers = 2 * m + 3, 3
    rope = rope_tables(d)
    x = randn((m, hidden), dtype, g)
    w = randn(((h + 2 * kvh) * d, hidden), dtype, g, scale=hidden ** -0.5)
    b = randn(((h + 2 * kvh) * d,), dtype, g) if bias else None
    positions = torch.randint(0, rope.max_positions, (m,), generator=g).to(DEV)
    slots = random_slots(m, nb, bs, g, n_pad=n_pad, dtype=torch.int64)
    cache = randn((nb, layers, 2, bs, kvh, d), dtype, g)
    untouched = cache.clone()

    qkv = qkv_rope_store(x, w, b, h, kvh, positions, rope.cos, rope.sin, cache[:, 1], slots)

    assert qkv.shape == (m, (h + 2 * kvh) * d)
    proj = (x.double() @ w.double().T + (b.double() if bias else 0)).to(dtype)  # the projection, rounded
    q, k, v = qkv.view(m, h + 2 * kvh, d).split([h, kvh, kvh], dim=1)
    pq, pk, pv = proj.view(m, h + 2 * kvh, d).split([h, kvh, kvh], dim=1)
    # 16-bit: the projection, the tables, each product and the sum are rounded (torch's numerics): 2x TOL
    tol = 2 * TOL[dtype]
    assert rel_err(q, rope_reference(pq, positions, rope.cos, rope.sin)) < tol
    assert rel_err(k, rope_reference(pk, positions, rope.cos, rope.sin)) < tol
    assert rel_err(v, pv) < TOL[dtype]
    expected = untouched.clone()
    reference_store(expected, 1, k, v, slots)  # this kernel's own k and v, at the live slots only
    assert torch.equal(bits(cache), bits(expected))
    # the unfused path (skinny GEMV, then rope_and_store) agrees but for summation order (1 ulp here and there:
    # bit for bit in the interpreter, ~2e-3 relative in bf16 on an H200)
    ref = skinny_linear(x, w, b)
    rq, rk, rv = ref.view(m, h + 2 * kvh, d).split([h, kvh, kvh], dim=1)
    rope_and_store(rq, rk, rv, positions, rope.cos, rope.sin, untouched[:, 1], slots)
    assert rel_err(qkv, ref) < TOL[dtype]


@pytest.mark.parametrize("m,h,kvh,d,hidden,dtype,bias,bs,n_pad", [
    pytest.param(1, 4, 2, 16, 40, torch.float32, False, 8, 0, id="m1-gqa2-fp32"),
    pytest.param(2, 8, 1, 32, 64, torch.bfloat16, True, 16, 0, id="m2-gqa8-bf16-bias"),
    pytest.param(3, 2, 2, 16, 70, torch.float16, False, 8, 1, id="m3-mha-fp16-padding-slot"),
    pytest.param(2, 4, 1, 8, 33, torch.bfloat16, False, 16, 2, id="m2-all-padding"),
])
def test_qkv_rope_store_matches_references(m, h, kvh, d, hidden, dtype, bias, bs, n_pad):
    run_case(m, h, kvh, d, hidden, dtype, bias, bs, n_pad, seed=m * 100 + d + hidden)


def test_qkv_rope_store_rejects_bad_arguments():
    rope = rope_tables(8)
    cache = torch.zeros(4, 2, 8, 1, 8, device=DEV)
    args = dict(x=torch.zeros(1, 16, device=DEV), weight=torch.zeros(48, 16, device=DEV), bias=None, num_heads=4,
                num_kv_heads=1, positions=torch.zeros(1, dtype=torch.int64, device=DEV), cos=rope.cos, sin=rope.sin,
                kv_layer=cache, slots=torch.zeros(1, dtype=torch.int64, device=DEV))
    for name, bad in [("weight", torch.zeros(47, 16, device=DEV)), ("x", torch.zeros(17, 16, device=DEV)),
                      ("bias", torch.zeros(3, device=DEV)), ("positions", torch.zeros(2, dtype=torch.int64,
                                                                                     device=DEV)),
                      ("slots", torch.zeros(1, device=DEV)), ("kv_layer", torch.zeros(4, 2, 8, 2, 8, device=DEV))]:
        with pytest.raises(ValueError, match=rf"^{name} |^k must"):
            qkv_rope_store(**(args | {name: bad}))


@pytest.mark.skipif(not CUDA, reason="real sizes need a CUDA device")
@pytest.mark.parametrize("m", [1, 2])
def test_qkv_rope_store_llama_8b_size(m):
    run_case(m, 32, 8, 128, 4096, torch.bfloat16, False, 16, 0, seed=m)
