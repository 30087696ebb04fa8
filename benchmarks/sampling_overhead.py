"""The cost per decode step of the per-request sampling options, next to the plain step measured in the same run.

One engine, `--batch` requests of `--context` random prompt tokens, seeded sampling (temperature 0.8); for each case
the same prompts are prefilled, then `--steps` decode steps are timed (engine.step() wall time, median) while every
row is still running:
- plain: nothing but temperature and seed (the reference);
- penalties: presence 0.5, frequency 0.5, repetition 1.2 (engine.logits_processing);
- logit_bias: 64 random token ids biased by -5..5;
- json_schema: an object with one free string field (engine.grammar through llguidance): the string keeps most
  of the vocabulary allowed, so rows stay alive; a row the grammar ends early is reported in `rows_min`.
Prints one JSON line per case with step_ms, the ratio to plain, and the rows running at the smallest step.

    python benchmarks/sampling_overhead.py --model /tmp/l8b --device cuda
    python benchmarks/sampling_overhead.py --model tiny --device cpu --batch 8 --context 64 --steps 4

Grammar masks are filled on the CPU over the model's tokenizer: with a small tokenizer on a large vocabulary (the
random checkpoints carry tiny's 2,048-token one) they are cheaper than with a real 128k tokenizer; give
`--tokenizer-json` a full-vocabulary tokenizer.json to measure that.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
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


def _model_folder(model: str, tokenizer_json: str | None, tmp: str) -> str:
    """The model folder, or a copy of it (weights linked) whose tokenizer.json is `tokenizer_json`."""
    if not tokenizer_json:
        return model
    folder = Path(tmp) / "model"
    folder.mkdir()
    for f in Path(model).iterdir():
        (folder / f.name).symlink_to(f.resolve())
    (folder / "tokenizer.json").unlink()
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    return str(folder)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--tokenizer-json", help="a tokenizer.json to use instead of the model folder's")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(model=_model_folder(args.model, args.tokenizer_json, tmp), device=args.device,
                              dtype="bfloat16" if args.device == "cuda" else "auto", max_num_seqs=args.batch,
                              max_num_batched_tokens=8192, enable_prefix_caching=False,
                              kv_cache_memory_bytes=(16 << 30) if args.device == "cuda" else (256 << 20))
        engine = LLMEngine(config)
        gen = torch.Generator().manual_seed(0)
        vocab = engine.model_config.vocab_size
        prompts = [torch.randint(3, min(vocab, 2048), (args.context,), generator=gen).tolist()
                   for _ in range(args.batch)]
        reference = None
        for name, extra in _cases(vocab, gen).items():
            result = measure(engine, prompts, extra, args.steps, name, args.device)
            reference = reference or result["step_ms"]
            print(json.dumps({"case": name, "batch": args.batch, "context": args.context, **result,
                              "plain_step_ms": reference, "ratio_to_plain": round(result["step_ms"] / reference, 3),
                              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}),
                  flush=True)


if __name__ == "__main__":
    main()
