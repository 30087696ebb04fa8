"""The small Triton kernels of the GPU path (engine/kernels: kv_store, rope, rms_norm, silu_mul, block_copy)
against plain torch references. On the CPU they run in Triton's interpreter at small shapes; the tests marked
`cuda` repeat them at Llama-3-8B sizes where a GPU exists.

Outputs are poisoned (NaN, or NaN bit patterns for bitwise copies) so unwritten elements fail; caches are filled
with random values and compared whole, so writes outside the targeted slots/blocks fail too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import interpreting
from engine.kernels.block_copy import copy_blocks, gather_blocks, scatter_blocks
from engine.kernels.kv_store import store_kv
from engine.kernels.rms_norm import rms_norm
from engine.kernels.rope import apply_rope_, rope_and_store
from engine.kernels.silu_mul import silu_and_mul
from engine.model.rope import RotaryEmbedding, apply_rope

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="real-size runs need a CUDA device")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in out fails."""
    assert not torch.isnan(out).any(), "NaN in output (an element was not written)"
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers (NaN-poisoned copies compare bitwise)."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def randn(shape, dtype, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * scale).to(dtype).to(DEV)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- store_kv


def random_slots(t: int, nb: int, bs: int, g: torch.Generator, n_pad: int, dtype: torch.dtype) -> torch.Tensor:
    """[t] distinct slots in [0, nb * bs), the last n_pad replaced by -1 and shuffled in."""
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[t - n_pad:] = -1
    return slots[torch.randperm(t, generator=g)].to(dtype).to(DEV)


def reference_store(cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """cache[:, layer][slot // bs, 0/1, slot % bs] = k/v for the non-negative slots, by torch indexing."""
    keep = slots >= 0
    s = slots[keep].long()
    bs = cache.shape[3]
    cache[s // bs, layer, 0, s % bs] = k[keep]
    cache[s // bs, layer, 1, s % bs] = v[keep]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 8])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_writes_only_targeted_slots(dtype, bs, slot_dtype):
    g = gen(bs * 7 + (dtype == torch.float32) + 2 * (slot_dtype == torch.int32))
    nb, num_layers, kvh, d, t = 6, 3, 2, 16, 11
    cache = randn((nb, num_layers, 2, bs, kvh, d), dtype, g)
    k, v = randn((t, kvh, d), dtype, g), randn((t, kvh, d), dtype, g)
    slots = random_slots(t, nb, bs, g, n_pad=3, dtype=slot_dtype)
    ref = cache.clone()
    reference_store(ref, 1, k, v, slots)
    store_kv(k, v, cache[:, 1], slots)
    assert torch.equal(bits(cache), bits(ref))


def test_store_kv_strided_inputs_and_all_padding():
    g = gen(3)
    nb, bs, kvh, d, t = 4, 8, 2, 16, 5
    cache = randn((nb, 2, 2, bs, kvh, d), torch.float32, g)
    kv = randn((t, 2 * kvh * d + 8), torch.float32, g)  # k and v as views of one wider row
    k, v = kv[:, :kvh * d].view(t, kvh, d), kv[:, kvh * d:2 * kvh * d].view(t, kvh, d)
    slots = random_slots(t, nb, bs, g, n_pad=0, dtype=torch.int64)
    ref = cache.clone()
    reference_store(ref, 0, k, v, slots)
    store_kv(k, v, cache[:, 0], slots)
    assert torch.equal(cache, ref)
    store_kv(k, v, cache[:, 1], torch.full((t,), -1, dtype=torch.int64, device=DEV))
    assert torch.equal(cache, ref)


# ---------------------------------------------------------------------------------------------- rope


def rope_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float64 x * cos + rotate_half(x) * sin. x [T, H, D]; cos/sin [P, D] float32."""
    x = x.double()
    c, s = cos[positions.long()].double()[:, None], sin[positions.long()].double()[:, None]
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


def fused_qkv(t: int, h: int, kvh: int, d: int, dtype: torch.dtype, g: torch.Generator):
    """q [T, H, D], k, v [T, KVH, D] as strided views of one [T, (H + 2 KVH) D] projection output."""
    qkv = randn((t, (h + 2 * kvh) * d), dtype, g)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    return qkv, q, k, v


def rope_tables(d: int, max_pos: int = 4096) -> RotaryEmbedding:
    rope = RotaryEmbedding(d, max_pos, 500000.0, None)
    rope.build(DEV)
    return rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_apply_rope_on_strided_qkv_views(dtype, pos_dtype):
    g = gen(11 + (pos_dtype == torch.int32))
    t, h, kvh, d = 7, 4, 2, 32
    rope = rope_tables(d)
    qkv, q, k, v = fused_qkv(t, h, kvh, d, dtype, g)
    positions = torch.randint(0, rope.max_positions, (t,), generator=g).to(pos_dtype).to(DEV)
    q_ref, k_ref = rope_reference(q, positions, rope.cos, rope.sin), rope_reference(k, positions, rope.cos, rope.sin)
    q_torch, k_torch = apply_rope(q.clone(), k.clone(), *rope(positions.long(), dtype))
    v_before = v.clone()
    apply_rope_(q, k, positions, rope.cos, rope.sin)
    assert rel_err(q, q_ref) < TOL[dtype] and rel_err(k, k_ref) < TOL[dtype]
    assert torch.equal(v, v_before)
    # torch's rounding steps are reproduced: fp16 bit for bit in the interpreter; on a GPU the compiler may fuse a
    # multiply-add (one rounding fewer), so there, as for bf16 and fp32, the torch result is matched within tolerance.
    if dtype == torch.float16 and interpreting():
        assert torch.equal(q, q_torch) and torch.equal(k, k_torch)
    else:
        assert rel_err(q, q_torch) < TOL[dtype] and rel_err(k, k_torch) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 8])
def test_rope_and_store_equals_rope_then_store(dtype, bs):
    g = gen(21 + bs)
    t, h, kvh, d, nb, num_layers = 9, 4, 2, 32, 5, 3
    rope = rope_tables(d)
    qkv, q, k, v = fused_qkv(t, h, kvh, d, dtype, g)
    positions = torch.randint(0, rope.max_positions, (t,), generator=g).to(DEV)
    slots = random_slots(t, nb, bs, g, n_pad=2, dtype=torch.int64)
    cache = randn((nb, num_layers, 2, bs, kvh, d), dtype, g)
    q0, k0 = q.clone(), k.clone()
    # reference: the separate kernels (each checked above against torch) on a copy of the projection output
    qkv_ref = qkv.clone()
    q_ref, k_ref = qkv_ref[:, :h * d].view(t, h, d), qkv_ref[:, h * d:(h + kvh) * d].view(t, kvh, d)
    apply_rope_(q_ref, k_ref, positions, rope.cos, rope.sin)
    cache_ref = cache.clone()
    reference_store(cache_ref, 2, k_ref, qkv_ref[:, (h + kvh) * d:].view(t, kvh, d), slots)
    rope_and_store(q, k, v, positions, rope.cos, rope.sin, cache[:, 2], slots)
    assert torch.equal(bits(qkv), bits(qkv_ref))
    assert torch.equal(bits(cache), bits(cache_ref))
    assert rel_err(q, rope_reference(q0, positions, rope.cos, rope.sin)) < TOL[dtype]
    assert rel_err(k, rope_reference(k0, positions, rope.cos, rope.sin)) < TOL[dtype]


# ---------------------------------------------------------------------------------------------- rms_norm


def rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def model_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """engine.model.decoder_layer.RMSNorm's arithmetic."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [64, 100])
def test_rms_norm(dtype, n):
    g = gen(31 + n)
    t, eps = 6, 1e-5
    x, w = randn((t, n), dtype, g, scale=3.0), randn((n,), dtype, g)
    out = torch.full((t, n), float("nan"), dtype=dtype, device=DEV)
    got = rms_norm(x, w, eps, out=out)
    assert got is out
    assert rel_err(out, rms_reference(x, w, eps)) < TOL[dtype]
    assert rel_err(out, model_rms(x, w, eps)) < TOL[dtype]
    allocated = rms_norm(x, w, eps)
    assert torch.equal(allocated, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_updates_residual_in_place(dtype):
    g = gen(41)
    t, n, eps = 5, 96, 1e-6
    base = randn((t, 2 * n), dtype, g)
    x = base[:, n:]  # a strided view, as a slice of a wider output
    residual, w = randn((t, n), dtype, g, scale=2.0), randn((n,), dtype, g)
    h_ref = (x.double() + residual.double())
    h_torch = x + residual  # what the model's bf16 add gives
    out = torch.full((t, n), float("nan"), dtype=dtype, device=DEV)
    got_out, got_res = rms_norm(x, w, eps, residual=residual, out=out)
    assert got_out is out and got_res is residual
    assert rel_err(residual, h_ref) < TOL[dtype]
    assert rel_err(residual, h_torch) < TOL[dtype]
    if dtype == torch.float32 or not interpreting():
        assert torch.equal(residual, h_torch)
    assert rel_err(out, rms_reference(h_torch, w, eps)) < TOL[dtype]
    assert rel_err(out, model_rms(h_torch, w, eps)) < TOL[dtype]


# ---------------------------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [40, 1500])
def test_silu_and_mul(dtype, inter):
    g = gen(51 + inter)
    t = 3
    gate_up = randn((t, 2 * inter), dtype, g, scale=3.0)
    out = torch.full((t, inter), float("nan"), dtype=dtype, device=DEV)
    assert silu_and_mul(gate_up, out=out) is out
    gate, up = gate_up[:, :inter].double(), gate_up[:, inter:].double()
    assert rel_err(out, gate * torch.sigmoid(gate) * up) < TOL[dtype]
    assert rel_err(out, F.silu(gate_up[:, :inter]) * gate_up[:, inter:]) < TOL[dtype]
    assert torch.equal(silu_and_mul(gate_up), out)


# ---------------------------------------------------------------------------------------------- block_copy

LAYER_RANGES = [(0, None), (1, 3), (2, 3)]


def poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def scattered_ids(n: int, nb: int, g: torch.Generator, dtype=torch.int64) -> torch.Tensor:
    """n distinct random ids in [0, nb) (no repeats), in random order."""
    return torch.randperm(nb, generator=g)[:n].to(dtype).to(DEV)


def cache_shape(nb: int, bs: int, num_layers: int = 4, kvh: int = 2, d: int = 8):
    return (nb, num_layers, 2, bs, kvh, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 8])
@pytest.mark.parametrize("layers", LAYER_RANGES)
def test_gather_blocks(dtype, bs, layers):
    g = gen(61 + bs + layers[0])
    cache = randn(cache_shape(12, bs), dtype, g)
    l0, l1 = layers[0], layers[1] or cache.shape[1]
    ids = scattered_ids(5, 12, g, torch.int32 if bs == 8 else torch.int64)
    out = poisoned((5, l1 - l0, *cache.shape[2:]), dtype)
    assert gather_blocks(cache, ids, out, *layers) is out
    assert torch.equal(bits(out), bits(cache[ids.long(), l0:l1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 8])
@pytest.mark.parametrize("layers", LAYER_RANGES)
def test_scatter_blocks_touches_only_targets(dtype, bs, layers):
    g = gen(71 + bs + layers[0])
    cache = randn(cache_shape(12, bs), dtype, g)
    l0, l1 = layers[0], layers[1] or cache.shape[1]
    ids = scattered_ids(5, 12, g)
    staging = randn((5, l1 - l0, *cache.shape[2:]), dtype, g)
    ref = cache.clone()
    ref[ids, l0:l1] = staging
    scatter_blocks(staging, cache, ids, *layers)
    assert torch.equal(bits(cache), bits(ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])  # fp8: kv_cache_dtype fp8 over cuda_ipc
@pytest.mark.parametrize("bs", [16, 8])
@pytest.mark.parametrize("layers", LAYER_RANGES)
def test_copy_blocks_between_caches(dtype, bs, layers):
    g = gen(81 + bs + layers[0])
    src = randn(cache_shape(12, bs), dtype, g)
    dst = randn(cache_shape(9, bs), dtype, g)
    l0, l1 = layers[0], layers[1] or src.shape[1]
    src_ids, dst_ids = scattered_ids(6, 12, g), scattered_ids(6, 9, g, torch.int32)
    ref = dst.clone()
    ref[dst_ids.long(), l0:l1] = src[src_ids, l0:l1]
    src_before = src.clone()
    copy_blocks(src, src_ids, dst, dst_ids, *layers)
    assert torch.equal(bits(dst), bits(ref))
    assert torch.equal(bits(src), bits(src_before))


def test_copy_blocks_within_one_cache():
    g = gen(91)
    cache = randn(cache_shape(10, 16), torch.float32, g)
    perm = scattered_ids(8, 10, g)
    src_ids, dst_ids = perm[:4], perm[4:]
    ref = cache.clone()
    ref[dst_ids, 1:3] = cache[src_ids, 1:3]
    copy_blocks(cache, src_ids, cache, dst_ids, 1, 3)
    assert torch.equal(cache, ref)


def test_block_copy_narrow_words_for_misaligned_buffers():
    # staging at a 2-byte offset: the kernel must fall back to int16 words and still copy exactly
    g = gen(95)
    cache = randn(cache_shape(7, 8), torch.bfloat16, g)
    ids = scattered_ids(3, 7, g)
    shape = (3, 2, *cache.shape[2:])
    buf = torch.full((1 + 3 * cache[0, :2].numel(),), float("nan"), dtype=torch.bfloat16, device=DEV)
    out = buf[1:].view(shape)
    gather_blocks(cache, ids, out, 2, 4)
    assert torch.equal(bits(out), bits(cache[ids, 2:4]))
    ref = cache.clone()
    staging = randn(shape, torch.bfloat16, g)
    buf[1:] = staging.reshape(-1)
    ref[ids, 2:4] = staging
    scatter_blocks(buf[1:].view(shape), cache, ids, 2, 4)
    assert torch.equal(bits(cache), bits(ref))


def test_block_copy_skips_out_of_range_ids():
    g = gen(97)
    cache = randn(cache_shape(6, 8), torch.float32, g)
    ids = torch.tensor([3, -1, 6, 0], device=DEV)
    out = poisoned((4, *cache.shape[1:]), torch.float32)
    gather_blocks(cache, ids, out)
    assert torch.equal(out[[0, 3]], cache[[3, 0]])
    assert torch.isnan(out[[1, 2]]).all()
    before = cache.clone()
    scatter_blocks(torch.zeros_like(out), cache, ids)
    assert (cache[[3, 0]] == 0).all() and torch.equal(cache[[1, 2, 4, 5]], before[[1, 2, 4, 5]])


def test_empty_inputs_are_no_ops():
    cache = torch.zeros(cache_shape(3, 8), device=DEV)
    ids = torch.zeros(0, dtype=torch.int64, device=DEV)
    gather_blocks(cache, ids, torch.empty((0, *cache.shape[1:]), device=DEV))
    copy_blocks(cache, ids, cache, ids)
    store_kv(torch.zeros(0, 2, 8, device=DEV), torch.zeros(0, 2, 8, device=DEV), cache[:, 0], ids)
    assert (cache == 0).all()


# ---------------------------------------------------------------------------------------------- argument errors


def _raises(name: str, fn, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=name):
        fn(*args, **kwargs)


def test_wrappers_reject_bad_arguments_naming_them():
    f32 = dict(dtype=torch.float32, device=DEV)
    cache = torch.zeros(cache_shape(4, 8), **f32)
    layer = cache[:, 0]
    k = torch.zeros(3, 2, 8, **f32)
    slots = torch.zeros(3, dtype=torch.int64, device=DEV)
    _raises("slots", store_kv, k, k, layer, slots.float())
    _raises("slots", store_kv, k, k, layer, slots[:2])
    _raises("k", store_kv, torch.zeros(3, 4, 8, **f32), k, layer, slots)
    _raises("v", store_kv, k, k.bfloat16(), layer, slots)
    _raises("kv_layer", store_kv, k, k, cache[:, 0, 0], slots)

    rope = rope_tables(8, 16)
    q = torch.zeros(3, 4, 8, **f32)
    pos = torch.zeros(3, dtype=torch.int64, device=DEV)
    _raises("cos", apply_rope_, q, k, pos, rope.cos.half(), rope.sin)
    _raises("sin", apply_rope_, q, k, pos, rope.cos, rope.sin[:, :4])
    _raises("q", apply_rope_, q.transpose(1, 2), k, pos, rope.cos, rope.sin)
    _raises("k", apply_rope_, q, k.bfloat16(), pos, rope.cos, rope.sin)
    _raises("positions", apply_rope_, q, k, pos.float(), rope.cos, rope.sin)
    _raises("slots", rope_and_store, q, k, k, pos, rope.cos, rope.sin, layer, slots[:1])

    x, w = torch.zeros(3, 16, **f32), torch.ones(16, **f32)
    _raises("weight", rms_norm, x, w[:8], 1e-5)
    _raises("weight", rms_norm, x, w.bfloat16(), 1e-5)
    _raises("residual", rms_norm, x, w, 1e-5, residual=torch.zeros(3, 8, **f32))
    _raises("out", rms_norm, x, w, 1e-5, out=torch.zeros(2, 16, **f32))
    r = x.clone()
    _raises("out", rms_norm, x, w, 1e-5, residual=r, out=r)
    _raises("x", rms_norm, x[0], w, 1e-5)

    _raises("gate_up", silu_and_mul, torch.zeros(2, 7, **f32))
    _raises("out", silu_and_mul, torch.zeros(2, 8, **f32), out=torch.zeros(2, 8, **f32))

    ids = torch.zeros(2, dtype=torch.int64, device=DEV)
    out = torch.zeros(2, *cache.shape[1:], **f32)
    _raises("block_ids", gather_blocks, cache, ids.float(), out)
    _raises("out", gather_blocks, cache, ids, out[:, :2])
    _raises("out", gather_blocks, cache, ids, out.bfloat16())
    _raises("layer_start", gather_blocks, cache, ids, out, 4)
    _raises("layer_end", gather_blocks, cache, ids, out[:, :1], 1, 1)
    _raises("layer_end", gather_blocks, cache, ids, out, 0, 5)
    _raises("cache", gather_blocks, cache.transpose(0, 1), ids, out)
    _raises("staging", scatter_blocks, out[:, :1], cache, ids)
    _raises("dst_cache", copy_blocks, cache, ids, cache.bfloat16(), ids)
    _raises("dst_cache", copy_blocks, cache, ids, torch.zeros(cache_shape(4, 16), **f32), ids)
    _raises("dst_ids", copy_blocks, cache, ids, cache, ids[:1])
    _raises("src_ids", copy_blocks, cache, ids.float(), cache, ids)


# ---------------------------------------------------------------------------------------------- real sizes (GPU)

L8B = dict(num_layers=32, kvh=8, d=128, bs=16, h=32, hidden=4096, inter=14336)


@cuda_only
def test_cuda_block_copy_llama8b_512_blocks():
    """1 GiB (512 scattered 2-MiB blocks) gathered, scattered and copied; prints the bandwidths it saw."""
    g = gen(101)
    nb = 1100
    shape = (nb, L8B["num_layers"], 2, L8B["bs"], L8B["kvh"], L8B["d"])
    cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    ids = scattered_ids(512, nb, g)
    out = torch.full((512, *shape[1:]), float("nan"), dtype=torch.bfloat16, device="cuda")
    gather_blocks(cache, ids, out)
    assert torch.equal(bits(out), bits(cache[ids]))
    dst_ids = scattered_ids(512, nb, gen(102))
    ref = cache.clone()
    ref[dst_ids] = out.flip(0)
    scatter_blocks(out.flip(0).contiguous(), cache, dst_ids)
    assert torch.equal(bits(cache), bits(ref))
    del ref
    part = torch.full((512, 8, *shape[2:]), float("nan"), dtype=torch.bfloat16, device="cuda")
    gather_blocks(cache, ids, part, 8, 16)
    assert torch.equal(bits(part), bits(cache[ids, 8:16]))

    def gbps(fn) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        return out.numel() * out.element_size() * 5 / (start.elapsed_time(end) * 1e-3) / 1e9

    print(f"\ngather {gbps(lambda: gather_blocks(cache, ids, out)):.0f} GB/s, "
          f"scatter {gbps(lambda: scatter_blocks(out, cache, dst_ids)):.0f} GB/s, "
          f"index_select {gbps(lambda: torch.index_select(cache, 0, ids, out=out)):.0f} GB/s (1 GiB, one GPU)")


@cuda_only
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_copy_blocks_from_a_peer_gpu():
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPU 0 cannot access GPU 1")
    g = gen(111)
    shape = (600, L8B["num_layers"], 2, L8B["bs"], L8B["kvh"], L8B["d"])
    src = torch.randn(shape, dtype=torch.bfloat16, device="cuda:1")
    dst = torch.randn(shape, dtype=torch.bfloat16, device="cuda:0")
    src_ids, dst_ids = scattered_ids(512, 600, g).to("cuda:0"), scattered_ids(512, 600, gen(112)).to("cuda:0")
    ref = dst.clone()
    ref[dst_ids] = src[src_ids.to("cuda:1")].to("cuda:0")  # torch's peer copy also enables peer access 0 -> 1
    copy_blocks(src, src_ids, dst, dst_ids)
    torch.cuda.synchronize(0)
    assert torch.equal(bits(dst), bits(ref))
    del ref
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(0):
        start.record()
        copy_blocks(src, src_ids, dst, dst_ids)
        end.record()
        torch.cuda.synchronize()
    print(f"\ncopy_blocks GPU1 -> GPU0, 512 blocks (1 GiB): {2**30 / (start.elapsed_time(end) * 1e-3) / 1e9:.0f} GB/s")


@cuda_only
def test_cuda_elementwise_llama8b_sizes():
    g = gen(121)
    t, h, kvh, d, bs = 256, L8B["h"], L8B["kvh"], L8B["d"], L8B["bs"]
    dtype = torch.bfloat16
    rope = rope_tables(d, 8192)
    qkv, q, k, v = fused_qkv(t, h, kvh, d, dtype, g)
    positions = torch.randint(0, 8192, (t,), generator=g).to(DEV)
    q_torch, k_torch = apply_rope(q.clone(), k.clone(), *rope(positions, dtype))
    slots = random_slots(t, 64, bs, g, n_pad=16, dtype=torch.int64)
    cache = torch.randn((64, L8B["num_layers"], 2, bs, kvh, d), dtype=dtype, device=DEV)
    cache_ref = cache.clone()
    reference_store(cache_ref, 17, k_torch, v, slots)
    rope_and_store(q, k, v, positions, rope.cos, rope.sin, cache[:, 17], slots)
    # bf16 RoPE may differ from torch's by one rounding (the compiler fuses a multiply-add): within tolerance
    assert rel_err(q, q_torch) < TOL[dtype] and rel_err(k, k_torch) < TOL[dtype]
    assert rel_err(cache, cache_ref) < TOL[dtype] and not cache.isnan().any()
    reference_store(cache_ref, 3, k, v, slots)
    store_kv(k, v, cache[:, 3], slots)
    assert torch.equal(bits(cache[:, 3]), bits(cache_ref[:, 3]))

    x, res, w = (randn((t, L8B["hidden"]), dtype, g), randn((t, L8B["hidden"]), dtype, g),
                 randn((L8B["hidden"],), dtype, g))
    h_torch = x + res
    out, res2 = rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(res, h_torch)
    assert rel_err(out, model_rms(h_torch, w, 1e-5)) < 1e-2
    gate_up = randn((t, 2 * L8B["inter"]), dtype, g)
    ref = F.silu(gate_up[:, :L8B["inter"]]) * gate_up[:, L8B["inter"]:]
    assert rel_err(silu_and_mul(gate_up), ref) < 1e-2


@cuda_only
def test_cuda_rope_and_store_in_a_cuda_graph():
    """Decode-style: the launch is captured once and replayed with new positions/slots (no host sync inside)."""
    g = gen(131)
    t, h, kvh, d, bs = 8, 4, 2, 64, 16
    rope = rope_tables(d)
    qkv = torch.zeros((t, (h + 2 * kvh) * d), dtype=torch.bfloat16, device=DEV)
    q, k, v = qkv[:, :h * d].view(t, h, d), qkv[:, h * d:(h + kvh) * d].view(t, kvh, d), qkv[:, (h + kvh) * d:]
    v = v.view(t, kvh, d)
    positions = torch.zeros(t, dtype=torch.int64, device=DEV)
    slots = torch.full((t,), -1, dtype=torch.int64, device=DEV)
    cache = torch.zeros((8, 2, 2, bs, kvh, d), dtype=torch.bfloat16, device=DEV)
    rope_and_store(q, k, v, positions, rope.cos, rope.sin, cache[:, 1], slots)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rope_and_store(q, k, v, positions, rope.cos, rope.sin, cache[:, 1], slots)
    new_qkv = randn(qkv.shape, torch.bfloat16, g)
    qkv.copy_(new_qkv)
    positions.copy_(torch.randint(0, 1000, (t,), generator=g))
    slots.copy_(random_slots(t, 8, bs, g, n_pad=2, dtype=torch.int64))
    cache.zero_()
    graph.replay()
    torch.cuda.synchronize()
    q_ref = new_qkv[:, :h * d].view(t, h, d).clone()
    k_ref = new_qkv[:, h * d:(h + kvh) * d].view(t, kvh, d).clone()
    v_ref = new_qkv[:, (h + kvh) * d:].reshape(t, kvh, d)
    q_ref, k_ref = apply_rope(q_ref, k_ref, *rope(positions, torch.bfloat16))
    cache_ref = torch.zeros_like(cache)
    reference_store(cache_ref, 1, k_ref, v_ref, slots)
    tol = TOL[torch.bfloat16]
    assert rel_err(q, q_ref) < tol and rel_err(k, k_ref) < tol and rel_err(cache, cache_ref) < tol
