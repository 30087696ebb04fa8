"""The decode attention asking the weight read next into L2 (engine.kernels.l2_prefetch): off unless
decode_launch.PREFETCH_MIN_PAIRS says so, never under the interpreter (it has no bulk prefetch), shares that cover
the weight in 16-byte granules, and on a GPU not one bit of the output changed by the prefetch or by its
evict-first K / V loads. Whether it is faster is benchmarks/step_ab.py's to say (not yet run on a GPU)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import decode_launch
from engine.kernels.decode_attention import decode_attention
from engine.kernels.decode_launch import AttentionLaunch, prefetch_share_bytes
from engine.kernels.l2_prefetch import ALIGN, share_bytes
from tests.test_kernels_attention import make_tables

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

CUDA = torch.cuda.is_available()


def test_shares_cover_the_weight_in_aligned_granules():
    weight = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn)
    for programs in (1, 7, 1024, 5000):
        share = share_bytes(weight, programs)
        assert share % ALIGN == 0 and share * programs >= weight.numel() > (share - ALIGN) * programs
    assert share_bytes(weight[:, :100], 8) == 0  # not contiguous: its bytes are not one range
    assert share_bytes(torch.empty(0, dtype=torch.bfloat16), 8) == 0
    assert share_bytes(torch.empty(17, dtype=torch.uint8)[1:], 8) == 0  # not 16-byte aligned


def test_no_launch_prefetches_unless_asked_and_never_in_the_interpreter(monkeypatch):
    weight = torch.empty(64, 64, dtype=torch.bfloat16)
    assert decode_launch.PREFETCH_MIN_PAIRS == 0 and decode_launch.KV_EVICT == ""  # off until a GPU times it
    assert prefetch_share_bytes(weight, 512, 1024, weight.device) == 0
    monkeypatch.setattr(decode_launch, "PREFETCH_MIN_PAIRS", 64)
    assert prefetch_share_bytes(None, 512, 1024, weight.device) == 0
    assert prefetch_share_bytes(weight, 63, 1024, weight.device) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert prefetch_share_bytes(weight, 512, 1024, weight.device) == 0
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert prefetch_share_bytes(weight, 512, 1024, weight.device) == share_bytes(weight, 1024) > 0
    assert decode_launch.kv_evict(True) == "evict_first" and decode_launch.kv_evict(False) == ""
    with pytest.raises(ValueError, match="prefetch must be on q's device"):
        prefetch_share_bytes(weight, 512, 1024, torch.device("meta"))


@pytest.mark.skipif(not CUDA, reason="the bulk prefetch and the L2 eviction hints exist only on a CUDA GPU (sm_90+)")
@pytest.mark.parametrize("cache", ["fp8", "bf16"])
def test_a_prefetching_launch_gives_the_same_bits(monkeypatch, cache):
    """64 sequences of 8 KV heads (the many-pairs launch an fp8 cache takes) and 3 of them (the 4-warp one), with
    o_proj's e4m3 weight of the 8B shape prefetched: every output bit as without it."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cp.async.bulk.prefetch needs Hopper (compute capability 9.0) or newer")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(11)
    bs, kvh, h, d, nb = 16, 8, 32, 128, 1400  # 64 contexts under 300 tokens: at most 1,216 distinct blocks
    weight = torch.randn(4096, 4096, generator=gen).to(torch.float8_e4m3fn).to(dev)
    kv = torch.randn(nb, 2, bs, kvh, d, generator=gen)
    kv = (kv.to(torch.float8_e4m3fn) if cache == "fp8" else kv.to(torch.bfloat16)).to(dev)
    for batch in (64, 3):
        contexts = [int(c) for c in torch.randint(1, 300, (batch,), generator=gen)]
        tables = make_tables(gen, contexts, bs, 20, nb)
        lens = torch.tensor(contexts, dtype=torch.int32, device=dev)
        q = torch.randn(batch, h, d, generator=gen).to(torch.bfloat16).to(dev)
        launches = [None] + ([AttentionLaunch(32, 1, 5, swapped=True)] if cache == "fp8" else [])
        for launch in launches:
            monkeypatch.setattr(decode_launch, "PREFETCH_MIN_PAIRS", 0)
            plain = decode_attention(q, kv, tables, lens, d ** -0.5, launch=launch, prefetch=weight)
            monkeypatch.setattr(decode_launch, "PREFETCH_MIN_PAIRS", 1)
            fetched = decode_attention(q, kv, tables, lens, d ** -0.5, launch=launch, prefetch=weight)
            torch.cuda.synchronize()
            assert torch.equal(fetched, plain), (batch, launch)
