"""A decode worker's memory per request levels off (docs/benchmark-log.md, "decode worker memory per request"): after
many short requests through its stream (the real tiny engine, a real Worker), every per-request structure of the
decode duty and the engine is back to empty, and the one structure that keeps growing with distinct prompts, the
prefix cache's hash map, holds at most one entry per KV block: a cache bounded by the blocks, not a leak."""

import asyncio

from decode_pool.worker_stream import StreamLink
from engine import SamplingParams
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
