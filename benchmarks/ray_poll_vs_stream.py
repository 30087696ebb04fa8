"""The coordinator's way of collecting a worker's step outputs, costed: one Ray long-poll call per batch (what
RayBackend._poll_loop does today) against one Ray streaming-generator call that yields every batch, unthrottled and
with backpressure 1 (the generator pauses until its last item is consumed: what keeps a long-poll's batching when
the reader falls behind).

An async actor stands in for a decode worker: each item is one step's deltas for `--streams` requests, as the
plain tuples decode_pool.step_delta sends. Printed per item: wall time and the caller process's CPU time (every
thread: Ray's own threads deserialize replies), for each way, and the ratio; the run repeats `--rounds` times.
The actor has an item ready at once, so this is the transport's own cost, not a step's.

    python benchmarks/ray_poll_vs_stream.py [--items 2000] [--streams 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import ray


def _batch(streams: int, step: int) -> list[tuple]:
    return [(f"req-{i}", [step], [], None, None) for i in range(streams)]


@ray.remote
class StepSource:
    def __init__(self, streams: int) -> None:
        self.streams, self.step = streams, 0

    async def poll(self) -> list[tuple]:
        self.step += 1
        return _batch(self.streams, self.step)

    async def stream(self, count: int):
        for step in range(count):
            yield _batch(self.streams, step)


async def _measure(source, items: int) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(items):
        await source.poll.remote()
    poll = (time.perf_counter() - wall, time.process_time() - cpu)
    wall, cpu = time.perf_counter(), time.process_time()
    async for ref in source.stream.remote(items):
        await ref
    stream = (time.perf_counter() - wall, time.process_time() - cpu)
    wall, cpu = time.perf_counter(), time.process_time()
    async for ref in source.stream.options(_generator_backpressure_num_objects=1).remote(items):
        await ref
    held = (time.perf_counter() - wall, time.process_time() - cpu)
    us = 1e6 / items
    return {"poll_wall_us": poll[0] * us, "poll_cpu_us": poll[1] * us,
            "stream_wall_us": stream[0] * us, "stream_cpu_us": stream[1] * us,
            "held_wall_us": held[0] * us, "held_cpu_us": held[1] * us}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    source = StepSource.remote(args.streams)
    ray.get(source.poll.remote())  # the actor is up
    for _ in range(args.rounds):
        r = asyncio.run(_measure(source, args.items))
        print(f"per item ({args.streams} deltas): long-poll {r['poll_wall_us']:.0f} us wall, "
              f"{r['poll_cpu_us']:.0f} us caller CPU; streaming generator {r['stream_wall_us']:.0f} us wall, "
              f"{r['stream_cpu_us']:.0f} us CPU ({r['stream_cpu_us'] / r['poll_cpu_us']:.2f} of the poll's); "
              f"with backpressure 1 {r['held_wall_us']:.0f} us wall, {r['held_cpu_us']:.0f} us CPU "
              f"({r['held_cpu_us'] / r['poll_cpu_us']:.2f})", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
