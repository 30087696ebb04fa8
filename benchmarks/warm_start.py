"""Cold vs warm engine: the same workload run twice on one fresh LLMEngine, with Triton compilations counted.

`python benchmarks/warm_start.py --model /tmp/l1b --device cuda` prints one JSON line per pass and a summary:
the wall time of each pass, the Triton kernel specialisations compiled during it (by kernel), and the ratio of the
first pass's time to the second's. The second pass is the reference: same request shapes and sampling options,
different token ids (so the prefix cache does not help it). A warm engine compiles nothing in either pass.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter

import torch
from triton import knobs

from engine.core.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine

VARIANTS = [  # the sampling options users send, cycled over the requests
    dict(temperature=0.0),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.7, top_k=50, seed=7),
    dict(temperature=0.0, logprobs=5),
    dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.2),
    dict(temperature=0.0, logit_bias={11: 5.0}),
    dict(temperature=0.9, min_p=0.05),
]


class CompileCounter:
    """Counts Triton compilations (in-memory cache misses) by kernel while installed."""

    def __init__(self) -> None:
        self.misses: Counter[str] = Counter()

    def __call__(self, *args, **kwargs) -> bool:
        self.misses[kwargs["fn"].name if "fn" in kwargs else "?"] += 1
        return False  # go on compiling

    def __enter__(self) -> CompileCounter:
        self._old = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self
        return self

    def __exit__(self, *exc: object) -> None:
        knobs.runtime.jit_cache_hook = self._old


def workload(seed: int, n: int, vocab: int, max_prompt: int) -> list[tuple[list[int], SamplingParams]]:
    """n requests: prompt lengths log-uniform in [4, max_prompt] (fixed by n, not seed), outputs 16-128."""
    shapes = random.Random(0)
    ids = random.Random(seed)
    out = []
    for i in range(n):
        plen = int(4 * (max_prompt / 4) ** shapes.random())
        params = SamplingParams(max_tokens=shapes.randint(16, 128), ignore_eos=True, **VARIANTS[i % len(VARIANTS)])
        out.append(([ids.randrange(3, vocab) for _ in range(plen)], params))
    return out


def run_pass(engine: LLMEngine, reqs: list, tag: str, wave: int) -> tuple[float, int]:
    """Adds `wave` requests every 4 steps (so prefills mix with running decodes) and steps until all finish."""
    start, steps, i = time.perf_counter(), 0, 0
    while i < len(reqs) or engine.has_unfinished():
        if steps % 4 == 0:
            for prompt, params in reqs[i:i + wave]:
                engine.add_request(f"{tag}-{i}", prompt, params)
                i += 1
        engine.step()
        steps += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - start, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--wave", type=int, default=6)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args()
    with CompileCounter() as startup:
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_num_seqs=args.max_num_seqs))
        start_s = time.perf_counter() - t0
    print(json.dumps({"phase": "start", "seconds": round(start_s, 2), "compiled": sum(startup.misses.values()),
                      "by_kernel": dict(startup.misses)}), flush=True)
    vocab = engine.model_config.vocab_size
    times = []
    for n, seed in enumerate((1, 2)):
        with CompileCounter() as counter:
            seconds, steps = run_pass(engine, workload(seed, args.requests, vocab, args.max_prompt), f"p{n}",
                                      args.wave)
        times.append(seconds)
        print(json.dumps({"phase": f"pass{n + 1}", "seconds": round(seconds, 3), "steps": steps,
                          "compiled": sum(counter.misses.values()), "by_kernel": dict(counter.misses)}), flush=True)
    print(json.dumps({"summary": "first pass time / second pass time (1.0 = no cold-start cost)",
                      "ratio": round(times[0] / times[1], 3), "model": args.model, "device": args.device}))


if __name__ == "__main__":
    main()
