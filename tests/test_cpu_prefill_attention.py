"""The CPU prefill-attention kernel (engine.cpu_kernels.prefill_attention, AMX) against attention in float32 from
the same bfloat16 inputs: whole prompts, chunks after a cached prefix, one-token chunks, several chunks in one call
over scattered blocks, head_dim 32/64/128 and GQA groups of 1, 2 and 4, equal within bfloat16 rounding; the rows of
other chunks untouched; bad inputs refused; and the engine with it gives the torch path's next-token distribution.
Skipped where the kernel cannot run (no AMX or no compiler)."""

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.cpu_kernels import prefill_attention as kernel

pytestmark = pytest.mark.skipif(kernel.load() is None, reason="the AMX prefill kernel cannot run here")
BS = 16


def case(spec: list[tuple[int, int]], dim: int = 32, heads: int = 8, kv_heads: int = 4, seed: int = 0):
    """(q, kv_layer, chunks, tables, max_ctx) for chunks of (length n, context ctx) over scattered blocks; the
    first rows of q (two) belong to no chunk, as a step's decode rows."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-ctx // BS) for _, ctx in spec) + 5
    kv = torch.randn(num_blocks, 2, BS, kv_heads, dim, generator=g).to(torch.bfloat16)
    q = torch.randn(2 + sum(n for n, _ in spec), heads, dim, generator=g).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g)
    width = max(-(-ctx // BS) for _, ctx in spec)
    tables = torch.zeros(len(spec), width, dtype=torch.int32)
    rows, start, used = [], 2, 0
    for c, (n, ctx) in enumerate(spec):
        nb = -(-ctx // BS)
        tables[c, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        rows.append((start, n, ctx))
        start += n
    return q, kv, torch.tensor(rows, dtype=torch.int32), tables, max(ctx for _, ctx in spec)


def reference(q, kv, chunks, tables, scale) -> dict[int, torch.Tensor]:
    """Each chunk's rows: float32 causal attention over its context (query i at position ctx - n + i)."""
    heads, kv_heads = q.shape[1], kv.shape[3]
    out = {}
    for (start, n, ctx), table in zip(chunks.tolist(), tables, strict=True):
        nb = -(-ctx // BS)
        blocks = table[:nb].long()
        k = kv[blocks, 0].reshape(nb * BS, kv_heads, -1)[:ctx].float().transpose(0, 1)
        v = kv[blocks, 1].reshape(nb * BS, kv_heads, -1)[:ctx].float().transpose(0, 1)
        k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
        o = F.scaled_dot_product_attention(q[start:start + n].float().transpose(0, 1), k, v, attn_mask=mask,
                                           scale=scale)
        out[start] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("spec,dim,heads,kv_heads", [
    ([(256, 256)], 32, 8, 4),                            # a whole prompt (tiny's shape)
    ([(7, 256), (249, 256)], 32, 8, 4),                  # a chunk after a cached prefix, and one of 7
    ([(1, 1), (5, 37), (16, 16), (17, 400)], 32, 8, 8),  # edges of the 16-row blocks and 32-key tiles, no GQA
    ([(100, 300), (33, 33)], 64, 8, 2),
    ([(40, 90), (3, 3)], 128, 4, 1),
])
def test_the_kernel_equals_float32_attention_within_bfloat16_rounding(spec, dim, heads, kv_heads):
    q, kv, chunks, tables, max_ctx = case(spec, dim, heads, kv_heads)
    scale = dim ** -0.5
    out = torch.full_like(q, 7.0)
    kernel.prefill_attention(q, kv, chunks, tables, max_ctx, scale, out)
    assert (out[:2] == 7.0).all()  # rows of no chunk untouched
    for start, want in reference(q, kv, chunks, tables, scale).items():
        got = out[start:start + want.shape[0]].float()
        assert (got - want).abs().max().item() <= 2 ** -7 * want.abs().max().item() + 2e-3, start


def test_bad_inputs_are_refused_with_a_message():
    q, kv, chunks, tables, max_ctx = case([(16, 16)])
    with pytest.raises(ValueError, match="bfloat16"):
        kernel.prefill_attention(q.float(), kv, chunks, tables, max_ctx, 0.1, q.float())
    with pytest.raises(ValueError, match="int32"):
        kernel.prefill_attention(q, kv, chunks.long(), tables, max_ctx, 0.1, torch.empty_like(q))
    with pytest.raises(ValueError, match="do not agree"):
        kernel.prefill_attention(q, kv, chunks, tables, max_ctx, 0.1, torch.empty_like(q)[:-1])


def test_the_engine_with_the_kernel_gives_the_torch_paths_distribution():
    """The same prompts (a whole one, and one longer than a step's chunk: its second chunk attends to a cached
    prefix) through one engine with the kernel and one without: the first tokens' top logprobs agree."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [list(range(3, 3 + 300)), list(range(900, 900 + 77))]
    results = []
    for on in (True, False):
        llm = LLM("tiny", dtype="bfloat16", max_num_batched_tokens=128)
        llm.engine.model.cpu_prefill_kernel = on
        results.append(llm.generate(prompts, params))
    assert LLM("tiny", dtype="bfloat16").engine.model.cpu_prefill_kernel  # the engine's default here
    for with_kernel, without in zip(*results, strict=True):
        a, b = with_kernel.logprobs[0].top_logprobs, without.logprobs[0].top_logprobs
        common = set(a) & set(b)
        assert len(common) >= 4 and all(abs(a[i] - b[i]) < 0.05 for i in common)
