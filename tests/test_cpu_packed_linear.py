"""oneDNN-packed linears on the CPU's torch path (engine.cpu_kernels.packed_linear): the same bits as nn.Linear,
chosen only where they apply (bfloat16, TP=1, not the `kernels: torch` reference), and the engine's greedy tokens
unchanged by them."""

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.cpu_kernels.packed_linear import PackedLinear, pack_linears, packs

needs_packing = pytest.mark.skipif(not packs(torch.bfloat16), reason="no oneDNN bfloat16 linears here")


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bitwise_the_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        want = linear(x)
        got = PackedLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
    assert torch.equal(got, want)


def test_only_bfloat16_packs():
    assert not packs(torch.float32) and not packs(torch.float16)


@needs_packing
def test_pack_linears_swaps_every_linear_and_nothing_else():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4), nn.Embedding(3, 4)))
    model = model.to(torch.bfloat16)
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    assert isinstance(model[2][1], nn.Embedding)


@needs_packing
def test_bfloat16_engine_packs_and_keeps_its_greedy_tokens(monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 9, [9, 10, 11], list(range(100, 160))]
    packed = LLM("tiny", dtype="bfloat16")
    assert isinstance(packed.engine.model.lm_head, PackedLinear)
    assert isinstance(packed.engine.model.model.layers[0].mlp.down_proj, PackedLinear)
    count = sum(p.numel() for p in packed.engine.model.parameters())
    monkeypatch.setattr("engine.model.decoder.CausalLM.use_packed_linears", lambda self: False)
    plain = LLM("tiny", dtype="bfloat16")  # the same engine (C decode attention), its linears left as they are
    assert type(plain.engine.model.lm_head) is nn.Linear
    assert count == sum(p.numel() for p in plain.engine.model.parameters())  # packed weights still counted
    assert [o.token_ids for o in packed.generate(prompts, params)] == \
        [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.logprobs for o in packed.generate(prompts, SamplingParams(temperature=0, max_tokens=4, logprobs=2))] \
        == [o.logprobs for o in plain.generate(prompts, SamplingParams(temperature=0, max_tokens=4, logprobs=2))]


def test_the_torch_reference_and_float32_do_not_pack():
    assert type(LLM("tiny", dtype="bfloat16", kernels="torch").engine.model.lm_head) is nn.Linear
    assert type(LLM("tiny").engine.model.lm_head) is nn.Linear  # tiny's own float32
