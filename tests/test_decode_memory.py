"""A decode worker's memory per request levels off (docs/benchmark-log.md, "decode worker memory per request"): after
many short requests through its stream (the real tiny engine, a real Worker), every per-request structure of the
decode duty and the engine is back to empty, and the one structure that keeps growing with distinct prompts, the
prefix cache's hash map, holds at most one entry per KV block: a cache bounded by the blocks, not a leak."""

import asyncio
import random
import tracemalloc

from decode_pool.worker_stream import StreamLink
from engine import SamplingParams
from engine.core import block_manager
from engine.core.block_manager import BlockManager
from engine.engine_config import EngineConfig
from pool_worker.worker import Worker

BLOCKS = 48
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def per_request(worker: Worker) -> dict[str, int]:
    d = worker.decodes
    e = worker.loop.engine
    return {"phases": len(d._phases), "group_prefills": len(d._group_prefills), "outbox": len(d._outbox),
            "timing": len(d._timing._open), "expected": len(d.handoffs._expected), "joins": len(d.handoffs._joins),
            "transferring": len(d.handoffs.transferring), "early": len(d.reservations),
            "requests": len(e.scheduler.requests), "tables": len(e.scheduler.bm._tables),
            "num_hashed": len(e.scheduler.bm._num_hashed)}


def test_per_request_structures_return_to_empty_and_the_prefix_cache_is_bounded_by_blocks():
    async def main():
        worker = Worker("decode-mem", EngineConfig(model="tiny", max_num_seqs=4, num_kv_blocks=BLOCKS), None, 1,
                        5.0, role="collocated", stream=True)
        info = await worker.start()
        link = StreamLink(*info.outputs_at)
        ended: set[str] = set()

        async def read():
            async for outputs, _, _, _ in link.batches():
                ended.update(fields[0] for fields in outputs if fields[3] is not None)
        reader = asyncio.create_task(read())
        try:
            while not link.connected:
                await asyncio.sleep(0.01)
            figures = []
            for batch in range(3):  # 3 x 20 requests of 2 full blocks each, all distinct: 120 blocks hashed
                ids = [f"r{batch}-{i}" for i in range(20)]
                for i, rid in enumerate(ids):
                    prompt = [3 + (batch * 20 + i + j) % 1900 for j in range(36)]
                    link.send(("generate", rid, prompt, PARAMS, [], 0))
                for _ in range(3000):
                    if ended.issuperset(ids):
                        break
                    await asyncio.sleep(0.01)
                assert ended.issuperset(ids)
                await asyncio.sleep(0.05)  # the step's last bookkeeping
                figures.append(await worker.loop.call(lambda e: (per_request(worker),
                                                                 len(e.scheduler.bm._hash_to_block))))
            return figures
        finally:
            reader.cancel()
            await worker.shutdown()
    figures = asyncio.run(main())
    for structures, hashes in figures:
        assert not any(structures.values()), structures
        assert hashes <= BLOCKS
    assert figures[-1][1] > BLOCKS // 2  # the cache did fill (the bound above is not vacuous)


def test_the_prefix_cache_bookkeeping_grows_past_a_full_hash_map_then_levels_off():
    """What the harness saw after the hash map's entry count was full: its and the LRU's own tables still grow,
    since CPython resizes a dict (an OrderedDict too) whose deleted slots ran out to the next power of two above 3x
    its entries, so the first resize after the map filled doubles them. That is the last growth: from then on the
    block manager's memory stays level however many distinct prompts pass, at under half a KB per block."""
    blocks, per_sample = 256, 20
    bm = BlockManager(blocks, 16)
    rng = random.Random(0)
    samples: list[tuple[int, int]] = []  # (entries in the hash map, bytes allocated in block_manager.py)
    only_here = [tracemalloc.Filter(True, block_manager.__file__)]
    tracemalloc.start()
    try:
        for i in range(200 * per_sample):  # ~2.7 full blocks per request: the map fills in ~100 requests
            tokens = [rng.randrange(3, 2000) for _ in range(rng.randrange(16, 80))]
            assert bm.allocate(f"r{i}", len(tokens) + 6, bm.cached_prefix(tokens))
            bm.cache_full_blocks(f"r{i}", tokens, len(tokens))
            bm.free(f"r{i}")
            if (i + 1) % per_sample == 0:
                traced = tracemalloc.take_snapshot().filter_traces(only_here)
                samples.append((len(bm._hash_to_block), sum(s.size for s in traced.statistics("filename"))))
    finally:
        tracemalloc.stop()
    full = next(i for i, (entries, _) in enumerate(samples) if entries >= blocks - 8)  # after ~120 requests
    after_full = [size for _, size in samples[full:]]
    assert after_full[-1] > after_full[0] + 8 * 1024, samples  # the tables still grew once the count was full
    settled = after_full[len(after_full) // 4:]  # ~1,000 requests on: 3,000 more requests, 30 more fills
    assert max(settled) - min(settled) < 512, samples  # level: no growth per request (a leak of one object would)
    assert max(after_full) < 512 * blocks, samples
