"""What the served worker's shape costs the engine's step: the closed loop of engine_neighbours.py run inside an
async Ray actor on an AsyncEngine (as pool_worker.worker runs it), with and without a driver long-polling its
outputs after every step (as the coordinator does).

Cases, interleaved `--repeats` times, each with new prompts (no prefix-cache hits):
  no_poll   the actor feeds itself: each finished request's successor is added from the outputs callback
  polled    the same, while this process calls the actor's `poll()` back to back (one Ray call per step)
Printed per case: host ms per engine step (the engine's own counters) and the run's wall time; `engine_neighbours.py`
gives the same loop on the bare engine. The two differ only by the Ray calls the actor answers: their Python runs
on the actor's threads and takes the GIL from the step thread.

    python benchmarks/worker_poll_cost.py --dtype bfloat16              # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import ray


@ray.remote(num_cpus=1, max_concurrency=100)
class ClosedLoopWorker:
    async def setup(self, model: str, dtype: str, concurrency: int, input_len: int, output_len: int) -> None:
        import torch

        from engine import LLM, SamplingParams
        from engine.async_engine import AsyncEngine
        torch.set_num_threads(1)
        self.params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        self.concurrency, self.input_len = concurrency, input_len
        self.outbox: list = []
        self.ready = asyncio.Event()
        self.finished = asyncio.Event()
        self.engine = AsyncEngine(LLM(model, dtype=dtype, max_num_seqs=concurrency).engine, self._on_outputs)
        asyncio.get_running_loop().create_task(self.engine.run())

    async def run(self, seed: int, num_prompts: int) -> tuple[float, float]:
        """(host ms per step, wall s) of one closed-loop run."""
        self.rng, self.seed, self.sent, self.live, self.total = random.Random(seed), seed, 0, 0, num_prompts
        self.finished.clear()
        steps, step_s = await self.engine.call(lambda e: (e.num_steps, e.step_time_total_s))
        start = time.perf_counter()
        for _ in range(self.concurrency):
            self._add_next()
        await self.finished.wait()
        steps2, step_s2 = await self.engine.call(lambda e: (e.num_steps, e.step_time_total_s))
        return (step_s2 - step_s) * 1000 / (steps2 - steps), time.perf_counter() - start

    async def poll(self) -> list[tuple[str, list[int], str | None]]:
        if not self.outbox:
            try:
                await asyncio.wait_for(self.ready.wait(), 1.0)
            except TimeoutError:
                pass
        out, self.outbox = self.outbox, []
        self.ready.clear()
        return [(o.request_id, o.new_token_ids, o.finish_reason) for o in out]

    def _on_outputs(self, outputs: list, load: object) -> None:
        for out in outputs:
            if out.finish_reason is not None:
                self.live -= 1
                self._add_next()
        self.outbox.extend(outputs)
        self.ready.set()

    def _add_next(self) -> None:
        if self.sent < self.total:
            rid, prompt = f"{self.seed}-{self.sent}", [self.rng.randrange(10, 2000) for _ in range(self.input_len)]
            self.sent, self.live = self.sent + 1, self.live + 1
            self.engine.submit(lambda e: e.add_request(rid, prompt, self.params))
        elif self.live == 0:
            self.finished.set()


def polled(worker: ray.actor.ActorHandle, seed: int, num_prompts: int) -> tuple[float, float, int]:
    run = worker.run.remote(seed, num_prompts)
    polls = 0
    while not ray.wait([run], timeout=0)[0]:
        ray.get(worker.poll.remote())
        polls += 1
    return (*ray.get(run), polls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    worker = ClosedLoopWorker.remote()
    ray.get(worker.setup.remote(args.model, args.dtype, args.concurrency, args.input_len, args.output_len))
    ray.get(worker.run.remote(1, args.num_prompts))  # warm-up
    seeds = iter(range(100, 100 + 2 * args.repeats))
    rows: dict[str, list[tuple[float, float]]] = {"no_poll": [], "polled": []}
    polls = []
    for _ in range(args.repeats):
        rows["no_poll"].append(ray.get(worker.run.remote(next(seeds), args.num_prompts)))
        ms, wall, n = polled(worker, next(seeds), args.num_prompts)
        rows["polled"].append((ms, wall))
        polls.append(n)
    base = statistics.median(ms for ms, _ in rows["no_poll"])
    print(f"{args.model} ({args.dtype}) in an async Ray actor: {args.num_prompts} prompts of {args.input_len} ids, "
          f"{args.output_len} out, {args.concurrency} in flight; medians of {args.repeats}; polls a run: {polls}")
    print(f"{'case':>8} {'step_ms':>8} {'wall_s':>7} {'step / no_poll':>15}")
    for case, values in rows.items():
        ms = statistics.median(m for m, _ in values)
        print(f"{case:>8} {ms:>8.2f} {statistics.median(w for _, w in values):>7.2f} {ms / base:>15.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
