"""The CPU's fused bfloat16 RMSNorm, SiLU-and-mul and RoPE with the KV store (engine.cpu_kernels.elementwise) against
the torch path's ops they replace: the same values but for a rare last-bit rounding (RoPE and the store: the same
bits), the residual stream written in place as the GPU
kernel does, and the engine's choice of them (bfloat16 on the torch path only) with its next-token distribution
unchanged within rounding."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu_kernels import elementwise
from engine.model.decoder_layer import RMSNorm
from engine.model.mlp import MLP
from engine.model.rope import RotaryEmbedding, rotate
from engine.model.torch_attention import write_kv

needs_lib = pytest.mark.skipif(elementwise.load() is None, reason="no C compiler here")
BF16_ULP = 2 ** -7  # relative spacing of bfloat16 values


def _torch_norm(dim: int, weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(dim, 1e-5).to(torch.bfloat16)
    norm.weight.data.copy_(weight)
    return norm


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but where one rounding tipped the other way (at most one bfloat16 step of the value, on few elements)."""
    diff = (got.float() - want.float()).abs()
    assert (diff <= BF16_ULP * want.float().abs() + 1e-30).all()
    assert (diff > 0).float().mean().item() < 0.01


@needs_lib
@pytest.mark.parametrize("rows,dim", [(1, 256), (16, 256), (300, 96), (7, 4096)])
def test_rms_norm_with_and_without_residual(rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(torch.bfloat16)
    residual = torch.randn(rows, dim, generator=gen).to(torch.bfloat16)
    weight = (torch.rand(dim, generator=gen) + 0.5).to(torch.bfloat16)
    reference = _torch_norm(dim, weight)
    _close(elementwise.rms_norm(x, weight, 1e-5), reference(x))
    want, want_sum = reference(x, residual.clone())
    stream = residual.clone()
    got, got_sum = elementwise.rms_norm(x, weight, 1e-5, stream)
    assert got_sum is stream and torch.equal(got_sum, want_sum)  # the add rounds exactly as torch's
    _close(got, want)


@needs_lib
@pytest.mark.parametrize("rows,inter", [(1, 688), (16, 688), (129, 40)])
def test_silu_mul(rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(elementwise.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


@needs_lib
@pytest.mark.parametrize("rows,heads,kv_heads,dim", [(1, 8, 4, 32), (16, 8, 4, 32), (300, 4, 1, 64), (5, 8, 8, 128)])
def test_rope_store_equals_rotate_then_write_kv(rows, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(rows * heads + dim)
    width = (heads + 2 * kv_heads) * dim
    qkv = (torch.randn(rows, width, generator=gen) * 3).to(torch.bfloat16)
    rope = RotaryEmbedding(dim, 4096, 500000.0, None)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    cos, sin = rope(positions, torch.bfloat16)  # [T, 1, D]
    block_size, blocks = 16, rows // 16 + 4
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows]
    slots[0] = -1  # a padding row: stored nowhere
    kv = torch.randn(blocks, 2, block_size, kv_heads, dim, generator=gen).to(torch.bfloat16)
    want_kv = kv.clone()
    qk = rotate(qkv[:, :(heads + kv_heads) * dim].view(rows, heads + kv_heads, dim), cos, sin)
    keep = slots >= 0
    write_kv(want_kv, slots[keep], qk[keep, heads:], qkv[keep, (heads + kv_heads) * dim:].view(-1, kv_heads, dim))
    got_q = elementwise.rope_store(qkv, heads, kv_heads, cos, sin, kv, slots)
    assert torch.equal(got_q, qk[:, :heads]) and torch.equal(kv, want_kv)
    with pytest.raises(IndexError, match="past the cache"):
        elementwise.rope_store(qkv, heads, kv_heads, cos, sin, kv, torch.full((rows,), blocks * block_size))
    with pytest.raises(ValueError, match="bfloat16 only"):
        elementwise.rope_store(qkv, heads, kv_heads, cos, sin, kv.float(), slots)


@needs_lib
def test_bfloat16_engine_fuses_and_computes_the_same_distribution(monkeypatch):
    """The same first-token distribution as the unfused engine within bfloat16 rounding. Not the same greedy
    tokens: tiny's random weights give near-flat logits (top logprobs ~0.04 apart), so a last-bit rounding of one
    norm can pick another of the near-tied tokens a few steps in."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [[5, 6, 7, 8] * 9, [9, 10, 11], list(range(100, 160))]
    fused = LLM("tiny", dtype="bfloat16")
    layer = fused.engine.model.model.layers[0]
    assert layer.input_layernorm.cpu_fused and isinstance(layer.mlp, MLP) and layer.mlp.cpu_fused
    assert layer.self_attn.cpu_fused
    monkeypatch.setattr("engine.model.decoder.CausalLM.use_cpu_elementwise", lambda self: False)
    plain = LLM("tiny", dtype="bfloat16")
    assert not plain.engine.model.model.layers[0].input_layernorm.cpu_fused
    for got, want in zip(fused.generate(prompts, params), plain.generate(prompts, params), strict=True):
        got_top, want_top = got.logprobs[0].top_logprobs, want.logprobs[0].top_logprobs
        shared = got_top.keys() & want_top.keys()
        assert len(shared) >= 3
        assert all(abs(got_top[t] - want_top[t]) < 0.05 for t in shared)


def test_float32_and_the_torch_reference_do_not_fuse():
    assert not LLM("tiny").engine.model.model.norm.cpu_fused
    assert not LLM("tiny", dtype="bfloat16", kernels="torch").engine.model.model.norm.cpu_fused
