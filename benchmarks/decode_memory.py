"""Where a decode worker's memory goes per request: a prefill Worker and a decode Worker (pool_worker.worker, the
real tiny engine, real UCX agents, the decode worker's output stream) in this process, driven as the coordinator
drives them in disaggregated mode (reserve on decode, prefill, decode with a pull, release on prefill), over many
short requests with distinct prompts. Every `--every` requests it prints the process's RSS, the Python heap that
tracemalloc sees, and the sizes of the per-request structures of both duties; at the end the top growths between the
first sample after warm-up and the last, by allocating line (tracemalloc, `--frames` deep).

    python benchmarks/decode_memory.py --requests 3000 --every 250

Both workers share the process, so a growth is attributed by its traceback (decode_pool/, prefill_pool/, engine/)
and by the structure sizes, not by process.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import sys
import tracemalloc
from collections import Counter

os.environ["UCXPY_ENABLE_PYTHON_FUTURE"] = "0"  # two agents in one process (kvtransfer.backends.ucx.use_python_futures)

from decode_pool.worker_stream import StreamLink
from engine.core.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from kvtransfer import AgentConfig
from pool_worker.worker import Worker


def rss_kb() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def type_counts() -> Counter[str]:
    """How many objects the garbage collector tracks, by type name."""
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def sizes(obj: object, prefix: str, depth: int = 2) -> dict[str, int]:
    """len() of every dict / set / list attribute of obj (and of its attributes' attributes, `depth` deep)."""
    out: dict[str, int] = {}
    for name, value in vars(obj).items():
        if isinstance(value, dict | set | list):
            out[f"{prefix}.{name}"] = len(value)
        elif depth > 1 and hasattr(value, "__dict__") and type(value).__module__.split(".")[0] in (
                "decode_pool", "prefill_pool", "engine", "kvtransfer"):
            out |= sizes(value, f"{prefix}.{name}", depth - 1)
    return out


def engine_figures(worker: Worker, prefix: str) -> dict[str, int]:
    """The engine's per-request and per-block structures: requests, block tables, and the prefix cache's hash map
    (one entry per block that ever held a full block's KV, until the block is reused: bounded by the blocks), with
    the bytes of that map's and the LRU's own tables (sys.getsizeof: CPython resizes a dict's table, when its
    deleted slots run out, to the next power of two above 3x its entries, so these grow after the count is full,
    up to that bound)."""
    e = worker.loop.engine
    bm = e.scheduler.bm
    return {f"{prefix}.requests": len(e.scheduler.requests), f"{prefix}.tables": len(bm._tables),
            f"{prefix}.hashes": len(bm._hash_to_block), f"{prefix}.blocks": bm.num_blocks,
            f"{prefix}.hash_map_kb": sys.getsizeof(bm._hash_to_block) // 1024,
            f"{prefix}.lru_kb": sys.getsizeof(bm._cached) // 1024}


async def main(args: argparse.Namespace) -> None:
    agent = AgentConfig(backends=("ucx",), timeout_s=30.0)
    cfg = EngineConfig(model="tiny", max_num_seqs=16, num_kv_blocks=args.num_kv_blocks)
    prefill = Worker("prefill-m", cfg, agent, 1, 30.0, role="prefill")
    decode = Worker("decode-m", cfg, agent, 1, 30.0, role="decode", stream=True)
    p_info, d_info = await prefill.start(), await decode.start()
    await decode.add_peer(p_info.agent_metadata)
    await prefill.add_peer(d_info.agent_metadata)
    link = StreamLink(*d_info.outputs_at)
    finished: dict[str, asyncio.Event] = {}

    async def read() -> None:
        async for outputs, _, _, _ in link.batches():
            for fields in outputs:
                if fields[3] is not None:  # StepDelta.finish_reason
                    ev = finished.get(fields[0])
                    if ev is not None:
                        ev.set()
    reader = asyncio.create_task(read())
    while not link.connected:
        await asyncio.sleep(0.01)

    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    async def one(i: int) -> None:
        rid = f"req-{i}"
        prompt = [rng.randrange(3, 2000) for _ in range(rng.randrange(16, 80))]
        finished[rid] = asyncio.Event()
        await decode.reserve(rid, prompt)
        result = await prefill.prefill(rid, prompt, params)
        await decode.decode(rid, prompt, params, result.first_token_id, result.first_logprob, "prefill-m",
                            result.block_ids)
        await prefill.release(rid)
        await asyncio.wait_for(finished[rid].wait(), 60)
        del finished[rid]

    tracemalloc.start(args.frames)
    base = None
    base_types: Counter[str] = Counter()
    sem = asyncio.Semaphore(args.concurrency)

    async def limited(i: int) -> None:
        async with sem:
            await one(i)
    done = 0
    print("requests,rss_kb,traced_kb,structures(decode | prefill, nonzero)", flush=True)
    while done < args.requests:
        await asyncio.gather(*(limited(i) for i in range(done, done + args.every)))
        done += args.every
        await asyncio.sleep(0.5)  # stragglers' releases and the engine's last step
        gc.collect()
        struct = {k: v for k, v in (sizes(decode.decodes, "D") | sizes(prefill.prefills, "P")).items() if v}
        struct |= engine_figures(decode, "D.engine") | engine_figures(prefill, "P.engine")
        print(f"{done},{rss_kb()},{tracemalloc.get_traced_memory()[0] // 1024},{struct}", flush=True)
        if done == args.warmup:
            base = tracemalloc.take_snapshot()
            base_types = type_counts()
    last = tracemalloc.take_snapshot()
    if base is not None:
        grown = Counter(type_counts())
        grown.subtract(base_types)
        print(f"\nobjects tracked by gc, growth over the last {args.requests - args.warmup} requests (type: count):")
        for name, n in grown.most_common(args.top):
            if n > 0:
                print(f"  {name}: {n:+d}")
        keep = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib*")]
        stats = last.filter_traces(keep).compare_to(base.filter_traces(keep), "traceback")
        n = args.requests - args.warmup
        print(f"\ntop growths over the last {n} requests (bytes, bytes per request, blocks):")
        for s in stats[:args.top]:
            print(f"{s.size_diff:+10d} {s.size_diff / n:+8.1f} {s.count_diff:+6d}")
            for line in s.traceback.format()[-2 * args.frames:]:
                print("     ", line)
    reader.cancel()
    await prefill.shutdown()
    await decode.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--warmup", type=int, default=500, help="the diff's base snapshot is taken after this many")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--frames", type=int, default=6)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--num-kv-blocks", type=int, default=None,
                    help="KV blocks per engine (default: sized from memory); a few hundred fill the prefix cache early")
    asyncio.run(main(ap.parse_args()))
