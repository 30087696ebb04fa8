"""Prefix blocks lent by one engine and fetched by another (engine.prefix_exchange), on two offline engines: the
lender's history, evicted from its device into its host tier, is copied up and lent; the fetcher books blocks for
it, gets the KV (copied here between the two engines' caches, as kvtransfer's pull does between workers:
tests/test_prefix_fetch_serving.py runs the real one), adopts them, and its prefill of the next turn finds them as
prefix hits: its output equals a cold engine's, greedy and seeded. Every block is accounted for on both sides, a
lease ends cleanly, and ids in use or partial blocks are refused. A worker's leases (pool_worker.prefix_share) end by
the coordinator, by their timer, or before their lend lands; a refused booking computes instead of failing. On a GPU
(`bash benchmarks/gpu_run.sh tests`) the same runs take the CUDA path (copies up on the launch stream, the lend's
event)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts, run_alone

pytestmark = pytest.mark.gpu
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 2000
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_history_in_one_engines_host_tier_is_fetched_by_another_and_its_output_is_exact(checkpoints, params):
    folder = str(checkpoints.tiny())
    turn1, *others = random_prompts((40, 40, 40, 40), VOCAB, seed=44)
    lender = LLM(folder, device=DEVICE, num_kv_blocks=8, kv_host_cache_bytes=64 << 20).engine
    fetcher = LLM(folder, device=DEVICE, num_kv_blocks=16, kv_host_cache_bytes=0).engine
    cold = LLM(folder, device=DEVICE, num_kv_blocks=16, kv_host_cache_bytes=0, enable_prefix_caching=False).engine
    reply, _ = run_alone(lender, "t1", turn1, params)
    for i, other in enumerate(others):  # 8 device blocks: these push turn 1 out to the lender's host tier
        run_alone(lender, f"o{i}", other, params)
    turn2 = turn1 + reply + random_prompts((9,), VOCAB, seed=45)[0]
    assert lender.block_manager.cached_prefix(turn2) == []  # not on the lender's device: only its host tier has it
    bs = lender.config.block_size
    run = turn2[:(len(turn2) - 1) // bs * bs]  # whole blocks, the prompt's last token left to compute
    lent, event = lender.lend_prefix("lease-1", run)
    held = (len(turn1) + len(reply)) // bs  # the history's full blocks
    assert len(lent) == held and lender.load().lent_host_blocks_total == held
    assert (event is not None) == (DEVICE == "cuda")
    if event is not None:
        event.synchronize()
    lender.check_integrity()
    blocks, skip, fence = fetcher.book_prefix("lease-1", run[:held * bs])
    assert skip == 0 and len(blocks) == held
    assert fetcher.check_integrity()["pinned"] == held  # booked under the lease until adopted
    assert (fence.event is not None) == (DEVICE == "cuda")
    fetcher.kv_cache[blocks] = lender.kv_cache[lent].to(fetcher.kv_cache.device)  # what the pull moves
    fetcher.adopt_prefix("lease-1", run[:held * bs], skip)
    assert lender.end_lease("lease-1") and not lender.end_lease("lease-1")
    for e in (lender, fetcher):
        integrity = e.check_integrity()
        assert integrity["pinned"] == integrity["in_use"] == 0, integrity
    got, first = run_alone(fetcher, "t2", turn2, params)
    want, _ = run_alone(cold, "t2", turn2, params)
    assert got == want
    assert first.num_cached_tokens == held * bs and fetcher.load().fetched_blocks_total == held
    # the lender restored what it lent: its device finds the history now
    assert len(lender.block_manager.cached_prefix(turn2)) == held


def test_leases_refuse_ids_in_use_and_partial_blocks_and_an_ended_lease_frees_its_blocks(checkpoints):
    engine = LLM(str(checkpoints.tiny()), device=DEVICE, num_kv_blocks=8, kv_host_cache_bytes=0).engine
    prompt = random_prompts((40,), VOCAB, seed=46)[0]
    run_alone(engine, "a", prompt, GREEDY)
    bs = engine.config.block_size
    assert engine.lend_prefix("nothing", random_prompts((32,), VOCAB, seed=47)[0]) == ([], None)  # holds no run
    lent, _ = engine.lend_prefix("lease", prompt[:2 * bs])
    assert len(lent) == 2 and engine.check_integrity()["pinned"] == 2
    with pytest.raises(ValueError, match="already in use"):
        engine.lend_prefix("lease", prompt[:bs])
    with pytest.raises(ValueError, match="not whole blocks"):
        engine.book_prefix("other", prompt[:bs + 1])
    with pytest.raises(ValueError, match="not held"):
        engine.adopt_prefix("other", prompt[:bs], 0)
    assert engine.end_lease("lease")
    integrity = engine.check_integrity()
    assert integrity["pinned"] == 0 and integrity["cached"] >= 2


def test_a_workers_leases_end_by_the_coordinator_by_their_timer_or_before_they_land(checkpoints):
    """pool_worker.prefix_share on a running engine loop: a lease ended by the coordinator frees its blocks; one
    nobody ends is ended by its timer (LEASE_TIMEOUTS x the transfer timeout); an end that overtakes its lend makes
    the lend hold nothing; a fetch whose booking is refused (its id in use) computes instead of failing."""
    import asyncio

    from engine.async_engine import AsyncEngine
    from pool_worker.prefix_share import PrefixShare

    engine = LLM(str(checkpoints.tiny()), device="cpu", num_kv_blocks=16, kv_host_cache_bytes=0).engine
    prompt = random_prompts((40,), VOCAB, seed=48)[0]
    run_alone(engine, "a", prompt, GREEDY)
    run = prompt[:2 * engine.config.block_size]

    async def main():
        loop = AsyncEngine(engine, lambda outputs, load: None)
        task = asyncio.create_task(loop.run())
        share = PrefixShare("w", loop, None, timeout_s=0.05)
        try:
            assert len(await share.lend("l1", run)) == 2
            assert (await loop.call(lambda e: e.check_integrity()))["pinned"] == 2
            assert await share.end("l1") and not await share.end("l1")
            assert len(await share.lend("l2", run)) == 2
            await asyncio.sleep(0.5)  # its timer: 4 x 0.05 s
            assert (await loop.call(lambda e: e.check_integrity()))["pinned"] == 0  # ended by nobody but it
            assert not await share.end("l3")  # the coordinator gave up before its lend landed
            assert await share.lend("l3", run) == []
            assert len(await share.lend("l4", run)) == 2
            assert await share.fetch("l4", "elsewhere", [0, 1], run) == 0  # "l4" is in use here: no booking
            assert await share.end("l4")
            return await loop.call(lambda e: e.check_integrity())
        finally:
            loop.close()
            await task
    integrity = asyncio.run(main())
    assert integrity["pinned"] == integrity["in_use"] == 0, integrity
