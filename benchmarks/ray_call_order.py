"""How often Ray runs an async actor's calls out of the order one caller sent them: the reason workers remember the
ids they saw aborted or handed over (decode_pool.reservations) and the drill that reorders calls on purpose
(faults.call_jitter_s, pool_worker.call_jitter).

One local Ray, one async actor; for each gap, `--pairs` pairs of calls from one caller: a call carrying a prompt of
`--tokens` ids whose result the caller awaits (as the coordinator awaits a prefill), then, `gap` seconds later, a
second call naming the same id (as an abort does); `--in-flight` pairs are sent before the caller waits for them.
The actor logs which call of each pair began first; prints, per gap, the pairs whose second call ran first. No
timing is asserted anywhere: it is a count.

    python benchmarks/ray_call_order.py --pairs 2000 --gaps 0,0.001,0.01 --in-flight 1,50
"""

from __future__ import annotations

import argparse
import asyncio

import ray


@ray.remote
class Recorder:
    def __init__(self) -> None:
        self.first: dict[int, str] = {}

    async def first_call(self, pair: int, prompt: list[int]) -> None:
        self.first.setdefault(pair, "first")

    async def second_call(self, pair: int) -> None:
        self.first.setdefault(pair, "second")

    async def overtaken(self) -> int:
        return sum(1 for who in self.first.values() if who == "second")


async def count(pairs: int, gap_s: float, tokens: int, in_flight: int) -> int:
    """Pairs sent one after another, `in_flight` of them before the caller waits for their first calls' results."""
    actor = Recorder.remote()
    prompt = list(range(tokens))
    for start in range(0, pairs, in_flight):
        firsts = []
        for i in range(start, min(start + in_flight, pairs)):
            firsts.append(asyncio.ensure_future(actor.first_call.remote(i, prompt)))
            await asyncio.sleep(gap_s)
            actor.second_call.remote(i)
        await asyncio.gather(*firsts)
    await asyncio.sleep(1.0)  # the last second calls land
    return await actor.overtaken.remote()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--gaps", default="0,0.001,0.01", help="seconds between a pair's two calls, comma-separated")
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--in-flight", default="1,50", help="pairs sent before waiting for them, comma-separated")
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    print(f"ray {ray.__version__}; {args.pairs} pairs per case, {args.tokens}-id prompts")
    print("pairs in flight | gap (s) | second call ran first | share")
    for in_flight in (int(n) for n in args.in_flight.split(",")):
        for gap in (float(g) for g in args.gaps.split(",")):
            overtaken = asyncio.run(count(args.pairs, gap, args.tokens, in_flight))
            print(f"{in_flight} | {gap:g} | {overtaken} of {args.pairs} | {overtaken / args.pairs:.2%}")
    ray.shutdown()


if __name__ == "__main__":
    main()
