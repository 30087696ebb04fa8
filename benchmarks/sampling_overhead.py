"""The cost per decode step of the per-request sampling options, next to the plain step measured in the same run.

One engine, `--batch` requests of `--context` random prompt tokens, seeded sampling (temperature 0.8); for each case
the same prompts are prefilled, then `--steps` decode steps are timed (engine.step() wall time, median) while every
row is still running:
- plain: nothing but temperature and seed (the reference);
- penalties: presence 0.5, frequency 0.5, repetition 1.2 (engine.sampling.logits_processing);
- logit_bias: 64 random token ids biased by -5..5;
- json_schema: an object with one free string field (engine.sampling.grammar, llguidance): the string keeps most
  of the vocabulary allowed, so rows stay alive; a row the grammar ends early is reported in `rows_min`.
The cases run `--rounds` times, interleaved; each prints one JSON line with the median step over its rounds (each
round's median in `rounds_ms`), the ratio to plain's, and the fewest rows running at any timed step.

    python benchmarks/sampling_overhead.py --model /tmp/l8b --device cuda
    python benchmarks/sampling_overhead.py --preset small-128k --device cpu --batch 8 --context 64 --steps 4

`--preset` draws a random checkpoint of that shape (benchmarks/make_random_checkpoint.py) into a temporary folder
first. Grammar masks are filled on the CPU over the model's tokenizer, so their cost depends on its size: the random
checkpoints carry a tokenizer of exactly the model's vocabulary (benchmarks/vocab_tokenizer.py), 128,256 tokens for
the Llama 3 shapes; `tiny` has 2,048.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.make_random_checkpoint import PRESETS, write_checkpoint  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling.structured import StructuredSpec  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def _cases(vocab: int, gen: torch.Generator) -> dict[str, dict]:
    bias_ids = torch.randint(3, vocab, (64,), generator=gen).tolist()
    bias = {int(t): float(b) for t, b in zip(bias_ids, torch.linspace(-5, 5, 64).tolist(), strict=True)}
    return {"plain": {},
            "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
            "logit_bias": {"logit_bias": bias},
            "json_schema": {"structured": StructuredSpec.json_schema(SCHEMA)}}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(engine: LLMEngine, prompts: list[list[int]], extra: dict, steps: int, tag: str, device: str) -> dict:
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=steps + 16, ignore_eos=True, **extra)
        engine.add_request(f"{tag}-{i}", prompt, params)
    while engine.scheduler.waiting or any(r.num_pending_tokens > 1 for r in engine.scheduler.running):
        engine.step()  # prefill
    for _ in range(3):  # warm: graphs, grammar compilation, the processors' first tensors
        engine.step()
    _sync(device)
    times, rows = [], []
    for _ in range(steps):
        rows.append(len(engine.scheduler.running))
        start = time.perf_counter()
        engine.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return {"step_ms": round(statistics.median(times) * 1e3, 3), "rows_min": min(rows)}


def _model_folder(args: argparse.Namespace, tmp: str) -> str:
    """`--model`, or a random checkpoint of `--preset` drawn into `tmp`."""
    if args.model:
        return args.model
    folder = Path(tmp) / args.preset
    write_checkpoint(folder, PRESETS[args.preset], args.device)
    return str(folder)


def main() -> None:
    p = argparse.ArgumentParser()
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="tiny or a checkpoint folder")
    model.add_argument("--preset", choices=sorted(PRESETS), help="a random checkpoint of this shape, made first")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights in place (a --no-weights checkpoint: config and tokenizer only)")
    p.add_argument("--rounds", type=int, default=5, help="each case this many times, interleaved; medians")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(model=_model_folder(args, tmp), device=args.device,
                              dtype="bfloat16" if args.device == "cuda" else "float32", max_num_seqs=args.batch,
                              max_num_batched_tokens=8192, enable_prefix_caching=False, load_format=args.load_format,
                              kv_cache_memory_bytes=(16 << 30) if args.device == "cuda" else (256 << 20))
        engine = LLMEngine(config)
        gen = torch.Generator().manual_seed(0)
        vocab = engine.model_config.vocab_size
        specials = engine.tokenizer.special_token_ids
        regular = torch.tensor([i for i in range(vocab) if i not in specials])
        prompts = [regular[torch.randint(len(regular), (args.context,), generator=gen)].tolist()
                   for _ in range(args.batch)]
        cases = _cases(vocab, gen)
        runs: dict[str, list[dict]] = {name: [] for name in cases}
        for r in range(args.rounds):  # the cases interleaved, so a drift of the machine touches them all alike
            for name, extra in cases.items():
                runs[name].append(measure(engine, prompts, extra, args.steps, f"{name}-{r}", args.device))
        reference = statistics.median(run["step_ms"] for run in runs["plain"])
        for name, results in runs.items():
            step = statistics.median(run["step_ms"] for run in results)
            print(json.dumps({"case": name, "batch": args.batch, "context": args.context,
                              "vocab": vocab, "tokenizer_vocab": engine.tokenizer.vocab_size, "step_ms": round(step, 3),
                              "rounds_ms": [run["step_ms"] for run in results],
                              "rows_min": min(run["rows_min"] for run in results),
                              "plain_step_ms": reference, "ratio_to_plain": round(step / reference, 3),
                              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}),
                  flush=True)


if __name__ == "__main__":
    main()
