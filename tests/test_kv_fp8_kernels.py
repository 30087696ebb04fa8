"""The fp8 KV cache's kernels (engine.kv_quant): every store path quantizes exactly as the torch reference
(engine.kv_quant.quantize), and every attention path over an fp8 cache equals attention over the dequantized cache
(k8 * k_scale, v8 * v_scale) within the activations' rounding. Without a GPU the Triton kernels run in Triton's
interpreter."""

from __future__ import annotations

import pytest
import torch

from engine.cpu_kernels.paged_decode import load as load_cpu_decode
from engine.cpu_kernels.paged_decode import paged_decode_attention
from engine.kernels.decode_attention import decode_attention
from engine.kernels.decode_launch import AttentionLaunch
from engine.kernels.kv_store import store_kv
from engine.kernels.prefill_attention import prefill_attention
from engine.kernels.qkv_rope import qkv_rope_store
from engine.kernels.rope import apply_rope_, rope_and_store
from engine.kv_quant import dequantize, quantize
from tests.test_kernels_attention import make_tables, reference

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.37, 1.9


def _values(t: torch.Tensor) -> torch.Tensor:
    return t.float().cpu()  # -0.0 and 0.0 are the same value (a float32 rounding gives +0.0, torch's cast -0.0)


def test_quantize_rounds_and_saturates_like_torch():
    x = torch.tensor([1.9375, -1.0625, 460.0, -1e6, 1e-9, 0.3])
    assert _values(quantize(x, 1.0)).tolist() == [2.0, -1.0, 448.0, -448.0, 0.0, 0.3125]
    assert _values(quantize(x * 2, 2.0)).tolist() == _values(quantize(x, 1.0)).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_quantizes_like_the_torch_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    kv = torch.zeros(6, 2, 2, 4, 2, 32, dtype=FP8, device=DEV)  # [NB, L, 2, bs, KVH, D]
    k = (torch.randn(9, 2, 32, generator=gen) * 100).to(dtype).to(DEV)  # some beyond +-448 * K_SCALE
    v = torch.randn(9, 2, 32, generator=gen).to(dtype).to(DEV)
    slots = torch.tensor([0, 5, 6, -1, 23, 11, 12, 13, 2], device=DEV)
    store_kv(k, v, kv[:, 1], slots, K_SCALE, V_SCALE)
    want = torch.zeros_like(kv)
    ok = slots >= 0
    s = slots[ok]
    want[s // 4, 1, 0, s % 4] = quantize(k[ok], K_SCALE)
    want[s // 4, 1, 1, s % 4] = quantize(v[ok], V_SCALE)
    assert torch.equal(_values(kv), _values(want))
    assert int((k.abs() / K_SCALE > 448).sum()) > 0  # the clamp was exercised


def test_rope_stores_quantize_the_rotated_keys():
    """rope_and_store and the fused qkv projection store what apply_rope_ then quantize would."""
    gen = torch.Generator().manual_seed(1)
    h, kvh, d, hidden, t = 4, 2, 32, 64, 2
    cos = torch.randn(16, d, generator=gen).to(DEV)
    sin = torch.randn(16, d, generator=gen).to(DEV)
    pos = torch.tensor([3, 9], device=DEV)
    slots = torch.tensor([5, 2], device=DEV)
    x = torch.randn(t, hidden, generator=gen).to(torch.bfloat16).to(DEV)
    w = (torch.randn((h + 2 * kvh) * d, hidden, generator=gen) / 8).to(torch.bfloat16).to(DEV)
    qkv = x @ w.T
    q, k, v = (part.contiguous() for part in qkv.view(t, h + 2 * kvh, d).split([h, kvh, kvh], 1))
    q_ref, k_ref = q.clone(), k.clone()
    apply_rope_(q_ref, k_ref, pos, cos, sin)
    want_k, want_v = quantize(k_ref, K_SCALE), quantize(v, V_SCALE)

    kv = torch.zeros(2, 1, 2, 4, kvh, d, dtype=FP8, device=DEV)
    rope_and_store(q, k, v, pos, cos, sin, kv[:, 0], slots, K_SCALE, V_SCALE)
    assert torch.equal(_values(kv[slots // 4, 0, 0, slots % 4]), _values(want_k))
    assert torch.equal(_values(kv[slots // 4, 0, 1, slots % 4]), _values(want_v))

    kv2 = torch.zeros_like(kv)
    out = qkv_rope_store(x, w, None, h, kvh, pos, cos, sin, kv2[:, 0], slots, K_SCALE, V_SCALE)
    k_fused = out.view(t, h + 2 * kvh, d)[:, h:h + kvh]
    # the fused GEMV's k may differ from cuBLAS's in the last bit, so compare with its own output quantized
    assert torch.equal(_values(kv2[slots // 4, 0, 0, slots % 4]), _values(quantize(k_fused, K_SCALE)))
    assert (_values(kv2) != _values(kv)).float().mean() < 0.05


def _fp8_cache(gen: torch.Generator, nb: int, bs: int, kvh: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer view of an fp8 cache [NB, 2, bs, KVH, D] of random quantized K/V, its float64 dequantized copy)."""
    k = torch.randn(nb, bs, kvh, d, generator=gen) * 3
    v = torch.randn(nb, bs, kvh, d, generator=gen)
    kv = torch.stack([quantize(k, K_SCALE), quantize(v, V_SCALE)], 1).to(DEV)  # [NB, 2, bs, KVH, D]
    deq = torch.stack([kv[:, 0].double() * K_SCALE, kv[:, 1].double() * V_SCALE], 1)
    return kv, deq


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_attention_reads_an_fp8_cache(splits):
    gen = torch.Generator().manual_seed(2)
    bs, kvh, h, d, nb = 8, 2, 8, 32, 24
    kv, deq = _fp8_cache(gen, nb, bs, kvh, d)
    contexts = [1, 19, 40]
    tables = make_tables(gen, contexts, bs, 6, nb)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEV)
    q = torch.randn(3, h, d, generator=gen).to(torch.bfloat16).to(DEV)
    out = decode_attention(q, kv, tables, lens, d ** -0.5, num_splits=splits, k_scale=K_SCALE, v_scale=V_SCALE)
    for i, ctx in enumerate(contexts):
        want = reference(q[i:i + 1], deq, tables[i], ctx, d ** -0.5, None)[0]
        assert (out[i].double() - want).abs().max() < 2e-2



@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_attention_whole_tiles_and_v_words_change_no_result(cache, splits):
    """The kernel's two faster paths (AttentionLaunch: whole tiles without masks, an fp8 V widened from int32
    words) give what the kernel without them gives: contexts of whole 32-token tiles, a partial last tile, one
    token, a sliding window starting inside a block. Equal bits in the interpreter; on a GPU the builds differ and
    agree to float rounding."""
    gen = torch.Generator().manual_seed(5)
    bs, kvh, h, d, nb = 8, 2, 8, 32, 64
    contexts = [1, 32, 64, 100, 45]
    tables = make_tables(gen, contexts, bs, 14, nb)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEV)
    if cache == "fp8":
        kv, _ = _fp8_cache(gen, nb, bs, kvh, d)
    else:
        kv = torch.randn(nb, 2, bs, kvh, d, generator=gen).to(torch.bfloat16).to(DEV)
    q = torch.randn(len(contexts), h, d, generator=gen).to(torch.bfloat16).to(DEV)
    stages = 1 if DEV.type == "cpu" else 3
    for window in (None, 27):
        outs = [decode_attention(q, kv, tables, lens, d ** -0.5, sliding_window=window, num_splits=splits,
                                 k_scale=K_SCALE, v_scale=V_SCALE,
                                 launch=AttentionLaunch(32, 4, stages, whole_tiles=whole, v_words=words))
                for whole in (False, True) for words in (False, True)]
        for out in outs[1:]:
            if DEV.type == "cpu":
                assert torch.equal(out, outs[0])
            else:
                torch.testing.assert_close(out, outs[0], atol=2e-3, rtol=2e-2)

@pytest.mark.parametrize("cache", ["fp8", "bf16"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_attention_swapped_tiles_equal_the_unswapped(cache, group):
    """The swapped launch (AttentionLaunch.swapped: K . q^T and V^T . P^T) computes what the usual one does, with
    the exact and the lazy softmax, one split and three, a sliding window, the early first tile; GQA groups of 1, 4
    and 8 heads (padded to the MMA's 8 columns or filling them). Both within float rounding of the reference over the
    dequantized cache."""
    gen = torch.Generator().manual_seed(7 + group)
    bs, kvh, d, nb = 8, 2, 32, 64
    contexts = [1, 32, 64, 100, 45]
    tables = make_tables(gen, contexts, bs, 14, nb)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEV)
    if cache == "fp8":
        kv, deq = _fp8_cache(gen, nb, bs, kvh, d)
        scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    else:
        kv = deq = torch.randn(nb, 2, bs, kvh, d, generator=gen).to(torch.bfloat16).to(DEV)
        scales = {}
    q = torch.randn(len(contexts), group * kvh, d, generator=gen).to(torch.bfloat16).to(DEV)
    # on a GPU, 3 stages (one buffer) and 5 (the copies two tiles ahead: the launch an H200 timed fastest)
    for stages in (1,) if DEV.type == "cpu" else (3, 5):
        for window, splits, lazy, early in ((None, 1, False, False), (27, 3, False, True), (None, 3, True, False)):
            outs = [decode_attention(q, kv, tables, lens, d ** -0.5, sliding_window=window, num_splits=splits,
                                     launch=AttentionLaunch(32, 1, stages, lazy=lazy, swapped=swapped),
                                     early_kv=early, **scales) for swapped in (False, True)]
            torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=2e-2)
            for i, ctx in enumerate(contexts):
                want = reference(q[i:i + 1], deq, tables[i], ctx, d ** -0.5, window)[0]
                assert (outs[1][i].double() - want).abs().max() < 2e-2


def test_prefill_attention_reads_an_fp8_cache():
    gen = torch.Generator().manual_seed(3)
    bs, kvh, h, d, nb = 8, 2, 4, 32, 24
    kv, deq = _fp8_cache(gen, nb, bs, kvh, d)
    contexts, q_lens = [20, 33], [20, 9]  # a whole prompt, and a chunk after a cached prefix
    tables = make_tables(gen, contexts, bs, 5, nb)
    q = torch.randn(sum(q_lens), h, d, generator=gen).to(torch.bfloat16).to(DEV)
    starts = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32, device=DEV)
    lens = torch.tensor(contexts, dtype=torch.int32, device=DEV)
    out = prefill_attention(q, kv, tables, starts, lens, max(q_lens), d ** -0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    for i, ctx in enumerate(contexts):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        want = reference(q[rows], deq, tables[i], ctx, d ** -0.5, None)
        assert (out[rows].double() - want).abs().max() < 2e-2


@pytest.mark.skipif(load_cpu_decode() is None, reason="no C compiler for the CPU decode kernel")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [32, 24])  # 32: the AVX-512 body (a table gather); 24: the portable body
def test_cpu_decode_kernel_reads_an_fp8_cache(dtype, d):
    gen = torch.Generator().manual_seed(4)
    bs, kvh, h, nb = 8, 2, 8, 24
    k = torch.randn(nb, bs, kvh, d, generator=gen) * 3
    v = torch.randn(nb, bs, kvh, d, generator=gen)
    kv = torch.stack([quantize(k, K_SCALE), quantize(v, V_SCALE)], 1)
    deq = torch.stack([dequantize(kv[:, 0], K_SCALE, torch.float64), dequantize(kv[:, 1], V_SCALE, torch.float64)], 1)
    contexts = [1, 19, 40]
    tables = make_tables(gen, contexts, bs, 6, nb).cpu()
    q = torch.randn(3, h, d, generator=gen).to(dtype)
    out = paged_decode_attention(q, kv, tables, torch.tensor(contexts, dtype=torch.int32), d ** -0.5, None,
                                 k_scale=K_SCALE, v_scale=V_SCALE)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for i, ctx in enumerate(contexts):
        want = reference(q[i:i + 1], deq, tables[i], ctx, d ** -0.5, None)[0]
        assert (out[i].double() - want).abs().max() < tol
