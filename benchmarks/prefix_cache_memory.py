"""The prefix cache's bookkeeping over many distinct prompts: how much host memory a BlockManager holds, and when
it stops growing (docs/benchmark-log.md, "Decode worker memory per request").

Drives one BlockManager (`--blocks` KV blocks of 16 tokens) as a worker's scheduler does for a request: look up the
cached prefix, allocate the prompt plus a few output tokens, register the full blocks, free. Prompts are distinct
(16-79 random token ids, ~2.7 full blocks each). Every `--requests / --samples` requests it prints the hash map's
entries, the byte size of the hash map's and the LRU's own tables (sys.getsizeof), and every byte tracemalloc traces
to block_manager.py (tables, entries, digests, the per-block records).

    python benchmarks/prefix_cache_memory.py --blocks 2048 --requests 8000

The entry count is full after ~blocks / 2.7 requests; the tables resize later (CPython doubles a dict whose deleted
slots ran out to the next power of two above 3x its entries), after which nothing grows.
"""

from __future__ import annotations

import argparse
import random
import sys
import tracemalloc

from engine.core import block_manager
from engine.core.block_manager import BlockManager


def main(args: argparse.Namespace) -> None:
    tracemalloc.start()
    bm = BlockManager(args.blocks, 16)
    rng = random.Random(0)
    only_here = [tracemalloc.Filter(True, block_manager.__file__)]
    every = max(1, args.requests // args.samples)
    print("requests,hash_map_entries,hash_map_table_bytes,lru_table_bytes,block_manager_traced_bytes", flush=True)
    for i in range(args.requests):
        tokens = [rng.randrange(3, 2000) for _ in range(rng.randrange(16, 80))]
        rid = f"r{i}"
        if not bm.allocate(rid, len(tokens) + 6, bm.cached_prefix(tokens)):
            sys.exit(f"--blocks {args.blocks} cannot hold one request")
        bm.cache_full_blocks(rid, tokens, len(tokens))
        bm.free(rid)
        if (i + 1) % every == 0:
            traced = tracemalloc.take_snapshot().filter_traces(only_here)
            print(f"{i + 1},{len(bm._hash_to_block)},{sys.getsizeof(bm._hash_to_block)},"
                  f"{sys.getsizeof(bm._cached)},{sum(s.size for s in traced.statistics('filename'))}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=8000)
    ap.add_argument("--samples", type=int, default=20)
    main(ap.parse_args())
