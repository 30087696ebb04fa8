"""What sampling options and structured outputs cost, each next to a reference from the same run. Produces
docs/benchmarks.md's "Sampling options: cost per decode step" table (`overhead` on the GPU, `bash
benchmarks/gpu_run.sh sampling`; `grammar-masks` on the CPU for its last row) and the library choice in
docs/parameters.md ("Structured outputs and tools").

`python benchmarks/sampling_costs.py COMMAND [options]`:

- `overhead`: the cost per decode step of the per-request sampling options, next to the plain step measured in the
  same run. One engine, `--batch` requests of `--context` random prompt tokens, seeded sampling (temperature 0.8);
  for each case the same prompts are prefilled, then `--steps` decode steps are timed (engine.step() wall time,
  median) while every row is still running:
  plain: nothing but temperature and seed (the reference);
  penalties: presence 0.5, frequency 0.5, repetition 1.2 (engine.sampling.logits_processing);
  logit_bias: 64 random token ids biased by -5..5;
  json_schema: an object with one free string field (engine.sampling.grammar, llguidance): the string keeps most
  of the vocabulary allowed, so rows stay alive; a row the grammar ends early is reported in `rows_min`.
  The cases run `--rounds` times, interleaved; each prints one JSON line with the median step over its rounds (each
  round's median in `rounds_ms`), the ratio to plain's, and the fewest rows running at any timed step.
  `--preset` draws a random checkpoint of that shape (benchmarks/make_random_checkpoint.py) into a temporary folder
  first. Grammar masks are filled on the CPU over the model's tokenizer, so their cost depends on its size: the
  random checkpoints carry a tokenizer of exactly the model's vocabulary (benchmarks/vocab_tokenizer.py), 128,256
  tokens for the Llama 3 shapes; `tiny` has 2,048.
- `grammar-masks`: the grammar libraries' token-bitmask time for JSON schemas at batch 64 over a 128k vocabulary,
  and compile time. Structured outputs (engine.grammar) need one allowed-token bitmask per constrained row per
  decode step, filled on the CPU while the device runs the step. This measures the two candidate libraries on the
  machine it runs on, with the same tokenizer, the same 64 seeded random schemas (tests.json_schemas) and the same
  token streams (each row advances through the tokens of a valid instance of its schema, so masks are taken in
  every state a real generation goes through):
  tokenizer setup: building the library's view of the 128k vocabulary (once per engine);
  compile: schema -> a matcher able to give its first mask (xgrammar compiles eagerly, with its token-mask cache;
  llguidance builds its parser when the matcher is made and computes masks lazily), per schema, every schema new;
  mask at batch 64: one step's bitmasks for 64 rows with the library's own parallel batch fill, per step.
  The tokenizer is benchmarks/vocab_tokenizer.py's, synthesized for exactly `--vocab` ids (default Llama 3's
  128,256: 256 bytes, 127,744 merges, 256 special tokens at the top), the same one the random checkpoints carry, so
  the masks here are the masks a model of that vocabulary needs; no download is needed. xgrammar is optional
  (`--libs`). On the 2-core CPU machine (quiet), over a 128,256-token BPE trained on the Python standard library
  (this program's tokenizer before the synthesized one), xgrammar 0.2.8 against llguidance 1.9.1: mask step at
  batch 64 27.9 ms against 7.8 ms mean (70.8 / 14.3 ms p99), compile 26 against 0.6 ms mean per schema. Chosen:
  llguidance, by these figures and by maintenance (guidance-ai, used by vLLM and llama.cpp), and because it reads
  tokenizer.json itself and enforces multipleOf on numbers, which xgrammar 0.2.8 ignores with a warning.
  docs/parameters.md, "Structured outputs and tools", has both runs and docs/benchmark-log.md the runs over the
  synthesized tokenizer.

    python benchmarks/sampling_costs.py overhead --model /tmp/l8b --device cuda
    python benchmarks/sampling_costs.py overhead --preset small-128k --device cpu --batch 8 --context 64 --steps 4
    python benchmarks/sampling_costs.py grammar-masks [--steps 64] [--schemas 64] [--libs xgrammar,llguidance]

(Until f1a5769 these were two programs: sampling_overhead.py and grammar_masks.py.)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.make_random_checkpoint import LLAMA3_VOCAB, PRESETS, write_checkpoint  # noqa: E402
from benchmarks.vocab_tokenizer import build_tokenizer, special_ids  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.engine_config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling.structured import StructuredSpec  # noqa: E402
from tests.json_schemas import random_instance, random_schema  # noqa: E402

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


def overhead(args: argparse.Namespace) -> None:
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


LIBS = ("xgrammar", "llguidance")


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        import xgrammar as xgr
        from tokenizers import Tokenizer
        self.xgr = xgr
        tok = Tokenizer.from_str(tokenizer_json)
        vocab = [tok.id_to_token(i) for i in range(tok.get_vocab_size(with_added_tokens=True))]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=len(vocab), stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher()
        self.vocab_size = len(vocab)

    def matcher(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(self, m, token: int) -> bool:
        return m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        import llguidance
        import llguidance.torch
        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.vocab_size = self.tokenizer.vocab_size

    def matcher(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        m = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        self.ll.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def advance(self, m, token: int) -> bool:
        return m.consume_token(token)


def measure_library(lib_cls, tokenizer_json: str, eos: int, schemas: list[dict], streams: list[list[int]],
            steps: int, batch: int) -> dict[str, float]:
    start = time.perf_counter()
    lib = lib_cls(tokenizer_json, eos)
    setup_s = time.perf_counter() - start
    mask = torch.zeros(batch, (lib.vocab_size + 31) // 32, dtype=torch.int32)
    compile_s = []
    for schema in schemas:  # every schema new to the library: no cache hit
        start = time.perf_counter()
        m = lib.matcher(schema)
        lib.fill([m], mask[:1])
        compile_s.append(time.perf_counter() - start)
    rows = [lib.matcher(schemas[i % len(schemas)]) for i in range(batch)]
    pos = [0] * batch
    step_s = []
    for _ in range(steps):
        start = time.perf_counter()
        lib.fill(rows, mask)
        step_s.append(time.perf_counter() - start)
        for i, m in enumerate(rows):
            stream = streams[i % len(streams)]
            if pos[i] == len(stream):  # the document is complete: start it again on a fresh matcher
                rows[i], pos[i] = lib.matcher(schemas[i % len(schemas)]), 0
                continue
            assert (mask[i, stream[pos[i]] // 32] >> (stream[pos[i]] % 32)) & 1, \
                f"{lib.name} masked a valid token: {schemas[i % len(schemas)]} at {pos[i]} of {stream}"
            assert lib.advance(m, stream[pos[i]]), f"{lib.name} refused a valid token"
            pos[i] += 1
    step_s.sort()
    return {"setup_s": setup_s, "compile_ms_mean": 1e3 * statistics.mean(compile_s),
            "compile_ms_p90": 1e3 * sorted(compile_s)[int(0.9 * len(compile_s))],
            "mask_ms_mean": 1e3 * statistics.mean(step_s), "mask_ms_p50": 1e3 * step_s[len(step_s) // 2],
            "mask_ms_p99": 1e3 * step_s[min(len(step_s) - 1, int(0.99 * len(step_s)))]}


def grammar_masks(args: argparse.Namespace) -> None:
    ap = args.parser
    libs = [name for name in args.libs.split(",") if name]
    if not libs or set(libs) - set(LIBS):
        ap.error(f"--libs: expected names from {LIBS}, got {args.libs!r}")
    tok = build_tokenizer(args.vocab)
    tokenizer_json = tok.to_str()
    eos = special_ids(tok).eot
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(args.schemas)]
    streams = [tok.encode(json.dumps(random_instance(rng, s), separators=(",", ":")), add_special_tokens=False).ids
               for s in schemas]
    print(f"vocabulary {tok.get_vocab_size(with_added_tokens=True)} tokens, batch {args.batch}, {args.steps} steps, "
          f"{args.schemas} schemas, torch threads {torch.get_num_threads()}")
    classes = {cls.name: cls for cls in (XGrammar, LLGuidance)}
    results = {name: measure_library(classes[name], tokenizer_json, eos, schemas, streams, args.steps, args.batch)
               for name in libs}
    both = len(libs) == 2
    ratio = f"{libs[0][:3]}/{libs[1][:3]}" if both else ""
    print(f"{'':18}" + "".join(f"{name:>12}" for name in libs) + f"{ratio:>10}")
    for k in results[libs[0]]:
        row = [results[name][k] for name in libs]
        print(f"{k:18}" + "".join(f"{v:12.3f}" for v in row) + (f"{row[0] / row[1]:10.2f}" if both else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("overhead", help="the decode step with penalties, logit bias, a JSON schema, vs plain")
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
    p.set_defaults(run=overhead)
    p = commands.add_parser("grammar-masks", help="JSON-schema bitmasks at batch 64: llguidance against xgrammar")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--schemas", type=int, default=64)
    p.add_argument("--vocab", type=int, default=LLAMA3_VOCAB, help="the synthesized tokenizer's exact size")
    p.add_argument("--libs", default=",".join(LIBS), help=f"comma-separated, from {LIBS}")
    p.set_defaults(run=grammar_masks, parser=p)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
