"""engine.kernels.fp8_mm_rope (the FP8 tensor-core qkv projection with RoPE and the KV store in its epilogue) against
the two launches it replaces, fp8_mm then rope_and_store: the same qkv and the same cache bytes at the live slots,
nothing stored at padding slots, with a bias, split K, bf16 and fp8 caches. On the CPU in Triton's interpreter at
small shapes; with a GPU at Llama-3-8B's heads and hidden size."""

from __future__ import annotations

import pytest
import torch

from benchmarks.make_random_checkpoint import quantize_weight
from engine.kernels.fp8_gemm import fp8_mm
from engine.kernels.fp8_mm_rope import fits_head, fp8_mm_rope_store, rope_launch
from engine.kernels.rope import rope_and_store
from engine.model.fp8_linear import FP8
from engine.model.fp8_linear import quantize_rows as torch_quantize_rows
from engine.model.rope import RotaryEmbedding

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (H, KVH, D, hidden): Llama-3-8B's on a GPU; the interpreter runs every program in Python
SHAPE = (32, 8, 128, 4096) if DEVICE == "cuda" else (4, 2, 32, 96)
SPLIT_LAUNCH = (16, 16, 32, 4, 1) if DEVICE == "cpu" else (64, 64, 256, 4, 4)  # + SPLIT_K


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def case(m: int, kv_dtype: torch.dtype, bias: bool, pad: int, seed: int, shape=SHAPE):
    h, kvh, d, hidden = shape
    n = (h + 2 * kvh) * d
    rope = RotaryEmbedding(d, 4096, 500000.0, None)
    rope.build(DEVICE)
    xq, xs = torch_quantize_rows(rand(m, hidden, seed=seed), None)
    wq, ws = quantize_weight(rand(n, hidden, seed=seed + 1, dtype=torch.float32, scale=0.05), "channel")
    b = rand(n, seed=seed + 2) if bias else None
    gen = torch.Generator().manual_seed(seed + 3)
    positions = torch.randint(0, 4096, (m,), generator=gen).to(DEVICE)
    nb, bs = 2 * m + 3, 16
    slots = torch.randperm(nb * bs, generator=gen)[:m].to(DEVICE)
    slots[m - pad:] = -1  # the last `pad` rows are a CUDA graph's padding: nothing stored for them
    cache = (torch.randn(nb, 3, 2, bs, kvh, d, generator=gen) * 0.5).to(kv_dtype).to(DEVICE)
    return dict(x=xq, x_scales=xs, weight=wq, w_scales=ws.reshape(1, -1).contiguous(), bias=b, num_heads=h,
                num_kv_heads=kvh, positions=positions, cos=rope.cos, sin=rope.sin, slots=slots), cache


def unfused(args: dict, kv_layer: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    h, kvh = args["num_heads"], args["num_kv_heads"]
    qkv = fp8_mm(args["x"], args["x_scales"], args["weight"], args["w_scales"], args["bias"])
    q, k, v = qkv.view(qkv.shape[0], h + 2 * kvh, -1).split([h, kvh, kvh], dim=1)
    rope_and_store(q, k, v, args["positions"], args["cos"], args["sin"], kv_layer, args["slots"], k_scale, v_scale)
    return qkv


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("m,kv_dtype,bias,pad", [
    pytest.param(2, torch.bfloat16, False, 0, id="m2-bf16-cache"),
    pytest.param(5, FP8, True, 1, id="m5-fp8-cache-bias-padding"),
    pytest.param(16, FP8, False, 3, id="m16-fp8-cache-padding"),
    pytest.param(33, torch.bfloat16, True, 0, id="m33-two-token-tiles"),
])
def test_fused_projection_is_fp8_mm_then_rope_and_store(m, kv_dtype, bias, pad):
    """The same rounded products (the weight rows are paired, not re-summed), rotated and stored with rope.py's
    numerics: equal bits on the CPU; on a GPU the MMA sums a pair's rows in other tile positions, so up to one
    bfloat16 rounding (2^-7 of the largest value), and the stored cache up to one step of its own dtype."""
    args, cache = case(m, kv_dtype, bias, pad, seed=m)
    expected, original = cache.clone(), cache.clone()
    scales = (0.5, 2.0) if kv_dtype == FP8 else (1.0, 1.0)
    fused = fp8_mm_rope_store(**args, kv_layer=cache[:, 1], k_scale=scales[0], v_scale=scales[1])
    ref = unfused(args, expected[:, 1], *scales)
    assert fused.shape == ref.shape and fused.dtype == torch.bfloat16
    live = args["slots"] >= 0
    if DEVICE == "cpu":
        assert same_bits(fused, ref)
        assert same_bits(cache, expected)
    else:
        assert ((fused.float() - ref.float()).abs().max() / ref.float().abs().max()).item() <= 2 ** -7
        step = 2 ** -3 if kv_dtype == FP8 else 2 ** -7
        diff = (cache.float() - expected.float()).abs().max() / expected.float().abs().max()
        assert diff.item() <= step
    written = torch.zeros(cache.shape[0], cache.shape[3], dtype=torch.bool, device=DEVICE)  # [blocks, offsets]
    written.view(-1)[args["slots"][live]] = True
    by_slot = (cache.permute(0, 3, 1, 2, 4, 5).view(torch.uint8), expected.permute(0, 3, 1, 2, 4, 5).view(torch.uint8))
    assert torch.equal(by_slot[0][~written], by_slot[1][~written])  # every other slot of every layer as it was
    stored = cache[:, 1].permute(0, 2, 1, 3, 4)[written]  # [live rows, 2, KVH, D] of the layer written
    assert not (stored.float() == original[:, 1].permute(0, 2, 1, 3, 4)[written].float()).all(dim=(1, 2, 3)).any()


def test_a_tile_that_holds_a_whole_head():
    """D equal to the tile (Llama-3.2-1B's D = 64 on a GPU, 16 in the interpreter): one program a head, its pairs
    the head's two halves whole."""
    h, kvh, _, hidden = SHAPE
    d = 64 if DEVICE == "cuda" else 16
    args, cache = case(5, FP8, True, 1, seed=90, shape=(h, kvh, d, hidden))
    expected = cache.clone()
    fused = fp8_mm_rope_store(**args, kv_layer=cache[:, 1], k_scale=0.5, v_scale=2.0)
    ref = unfused(args, expected[:, 1], 0.5, 2.0)
    if DEVICE == "cpu":
        assert same_bits(fused, ref) and same_bits(cache, expected)
    else:
        assert ((fused.float() - ref.float()).abs().max() / ref.float().abs().max()).item() <= 2 ** -7
        assert ((cache.float() - expected.float()).abs().max() / expected.float().abs().max()).item() <= 2 ** -3


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_meets_on_the_callers_semaphores_and_leaves_them_zero(split_k):
    args, cache = case(16, FP8, True, 2, seed=70 + split_k)
    whole_cache = cache.clone()
    whole = fp8_mm_rope_store(**args, kv_layer=whole_cache[:, 1], config=(*SPLIT_LAUNCH, 1))
    sems = torch.zeros(1024, dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        split = fp8_mm_rope_store(**args, kv_layer=cache[:, 1], config=(*SPLIT_LAUNCH, split_k), semaphores=sems)
        assert ((split.float() - whole.float()).abs().max() / whole.float().abs().max()).item() <= 2 ** -7
        assert not sems.any()
    diff = (cache.float() - whole_cache.float()).abs().max() / whole_cache.float().abs().max()
    assert diff.item() <= 2 ** -3


def test_launch_keeps_its_tiles_inside_a_head_and_refuses_what_does_not_fit():
    if DEVICE == "cuda":  # the interpreter's launch is one small tile whatever the shape
        assert rope_launch(128, 64, 28672, 4096, 132)[0] == 64  # not the wide 128-row tiles this N would take
        assert fits_head(128) and fits_head(64) and not fits_head(96)
    else:
        assert fits_head(32) and fits_head(16) and not fits_head(24)
    args, cache = case(2, torch.bfloat16, False, 0, seed=5)
    with pytest.raises(ValueError, match="head_dim"):
        fp8_mm_rope_store(**args, kv_layer=cache[:, 1], config=(24, 16, 32, 4, 1, 1))  # 24 does not divide D
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_mm_rope_store(**(args | {"x": args["x"].to(torch.bfloat16), "x_scales": None}), kv_layer=cache[:, 1])
    with pytest.raises(ValueError, match="positions"):
        fp8_mm_rope_store(**(args | {"positions": args["positions"][:1]}), kv_layer=cache[:, 1])
