"""The C decode-attention kernel (engine.cpu_kernels.paged_decode) against the torch path it replaces on the CPU:
GQA groups, sliding windows, padding rows, strided layer views, float32 and bfloat16; the engine's choice of it;
and the torch path where it cannot be built."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu_kernels import paged_decode
from engine.model import torch_attention
from engine.model.attention_metadata import AttentionMetadata

needs_kernel = pytest.mark.skipif(paged_decode.load() is None, reason="no C compiler here")


def decode_meta(tables: torch.Tensor, context_lens: torch.Tensor, window: int | None) -> AttentionMetadata:
    width = tables.shape[1]
    return AttentionMetadata(
        slots=torch.zeros(tables.shape[0], dtype=torch.int64), num_decode=tables.shape[0],
        decode_block_tables=tables, decode_context_lens=context_lens,
        prefill_block_tables=torch.zeros(0, width, dtype=torch.int32),
        prefill_query_start=torch.zeros(1, dtype=torch.int32), prefill_context_lens=torch.zeros(0, dtype=torch.int32),
        prefill_lens=(), sliding_window=window)


@needs_kernel
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(8, 4, 32, None), (8, 8, 64, None), (12, 4, 32, 37),
                                                            (4, 1, 16, None), (6, 2, 128, 5)])
def test_kernel_equals_the_torch_path(dtype, tolerance, heads, kv_heads, head_dim, window):
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim)
    blocks, block_size, width = 64, 16, 6
    cache = torch.randn(blocks, 3, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    kv_layer = cache[:, 1]  # a layer of the whole cache: strided, as the model passes it
    tables = torch.randint(0, blocks, (6, width), dtype=torch.int32, generator=gen)
    context_lens = torch.tensor([1, 17, width * block_size, 40, 0, 16], dtype=torch.int32)  # 0: a padding row
    q = torch.randn(6, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    want = torch_attention.paged_attention(q, kv_layer, decode_meta(tables, context_lens, window), scale)
    got = paged_decode.paged_decode_attention(q, kv_layer, tables, context_lens, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    live = context_lens > 0
    assert (got[live].float() - want[live].float()).abs().max().item() <= tolerance
    assert not got[~live].any()  # a padding row comes back as zeros
    into = torch.full_like(q, 7.0)
    assert paged_decode.paged_decode_attention(q, kv_layer, tables, context_lens, scale, window, out=into) is into
    assert torch.equal(into, got)


@needs_kernel
def test_the_plan_routes_decode_rows_to_the_kernel():
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(32, 2, 16, 2, 32, generator=gen)
    tables = torch.randint(0, 32, (3, 4), dtype=torch.int32, generator=gen)
    context_lens = torch.tensor([5, 64, 33], dtype=torch.int32)
    q = torch.randn(3, 4, 32, generator=gen)
    meta = decode_meta(tables, context_lens, None)
    routed = torch_attention.with_plan(meta, cache, decode_kernel=True)
    assert routed.torch_plan.decode_kernel and routed.torch_plan.decode_blocks is None
    want = torch_attention.paged_attention(q, cache, meta, 0.2)
    assert torch.allclose(torch_attention.paged_attention(q, cache, routed, 0.2), want, atol=2e-6)


def test_mismatched_shapes_are_refused():
    q = torch.zeros(2, 8, 32)
    with pytest.raises(ValueError, match="do not agree"):
        paged_decode.paged_decode_attention(q, torch.zeros(4, 2, 16, 3, 32), torch.zeros(2, 1, dtype=torch.int32),
                                            torch.ones(2, dtype=torch.int32), 1.0, None)
    with pytest.raises(ValueError, match="do not agree"):  # a cache of another dtype than q
        paged_decode.paged_decode_attention(q, torch.zeros(4, 2, 16, 4, 32, dtype=torch.bfloat16),
                                            torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                                            1.0, None)
    with pytest.raises(ValueError, match="out must be"):
        paged_decode.paged_decode_attention(q, torch.zeros(4, 2, 16, 4, 32), torch.zeros(2, 1, dtype=torch.int32),
                                            torch.ones(2, dtype=torch.int32), 1.0, None, out=torch.zeros(2, 8, 16))


@pytest.mark.parametrize("tables,context_lens,match", [
    ([[0, 1], [2, 3]], [33, 5], "exceeds its block table"),  # 33 tokens in 2 blocks of 16
    ([[0, 4], [2, 3]], [20, 5], r"in \[0, 4\)"),  # block 4 of a 4-block cache
    ([[0, -1], [2, 3]], [20, 5], r"in \[0, 4\)")])
def test_tables_pointing_outside_the_cache_are_refused(tables, context_lens, match):
    with pytest.raises(ValueError, match=match):
        paged_decode.paged_decode_attention(torch.zeros(2, 4, 32), torch.zeros(4, 2, 16, 2, 32),
                                            torch.tensor(tables, dtype=torch.int32),
                                            torch.tensor(context_lens, dtype=torch.int32), 1.0, None)


def test_engine_uses_the_kernel_by_default_and_not_with_torch_kernels():
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 9, [9, 10, 11]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a served worker's (num_cpus 1)
    try:
        default, reference = LLM("tiny"), LLM("tiny", kernels="torch")
    finally:
        torch.set_num_threads(threads)
    assert default.engine.model.cpu_decode_kernel == (paged_decode.load() is not None)
    assert not reference.engine.model.cpu_decode_kernel
    assert [o.token_ids for o in default.generate(prompts, params)] == \
        [o.token_ids for o in reference.generate(prompts, params)]


def test_engines_on_many_threads_keep_the_torch_path():
    threads = torch.get_num_threads()
    torch.set_num_threads(paged_decode.MAX_THREADS + 1)
    try:
        assert not LLM("tiny").engine.model.cpu_decode_kernel
    finally:
        torch.set_num_threads(threads)


def test_without_a_compiler_the_engine_keeps_the_torch_path(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    paged_decode.load.cache_clear()
    try:
        assert paged_decode.load() is None
        assert not LLM("tiny").engine.model.cpu_decode_kernel
    finally:
        monkeypatch.delenv("CC")
        paged_decode.load.cache_clear()
