"""Grammar-library benchmark: token-bitmask time for JSON schemas at batch 64 over a 128k vocabulary, and compile time.

Why this exists: structured outputs (engine.grammar) need one allowed-token bitmask per constrained row per decode
step, filled on the CPU while the device runs the step. This program measures the two candidate libraries on the
machine it runs on, with the same tokenizer, the same 64 seeded random schemas (tests.json_schemas) and the same
token streams (each row advances through the tokens of a valid instance of its schema, so masks are taken in every
state a real generation goes through):
- tokenizer setup: building the library's view of the 128k vocabulary (once per engine);
- compile: schema -> a matcher able to give its first mask (xgrammar compiles eagerly, with its token-mask cache;
  llguidance builds its parser when the matcher is made and computes masks lazily), per schema, every schema new;
- mask at batch 64: one step's bitmasks for 64 rows with the library's own parallel batch fill, per step.

The tokenizer is benchmarks/vocab_tokenizer.py's, synthesized for exactly `--vocab` ids (default Llama 3's 128,256:
256 bytes, 127,744 merges, 256 special tokens at the top), the same one the random checkpoints carry, so the masks
here are the masks a model of that vocabulary needs; no download is needed. xgrammar is optional (`--libs`).

Run: `python benchmarks/grammar_masks.py [--steps 64] [--schemas 64] [--libs xgrammar,llguidance]`. On the 2-core
CPU machine (quiet), over a 128,256-token BPE trained on the Python standard library (this program's tokenizer
before the synthesized one), xgrammar 0.2.8 against llguidance 1.9.1: mask step at batch 64 27.9 ms against 7.8 ms
mean (70.8 / 14.3 ms p99), compile 26 against 0.6 ms mean per schema. Chosen: llguidance, by these figures and by
maintenance (guidance-ai, used by vLLM and llama.cpp), and because it reads tokenizer.json itself and enforces
multipleOf on numbers, which xgrammar 0.2.8 ignores with a warning. docs/parameters.md, "Structured outputs and
tools", has both runs and docs/benchmark-log.md the runs over the synthesized tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.make_random_checkpoint import LLAMA3_VOCAB  # noqa: E402
from benchmarks.vocab_tokenizer import build_tokenizer, special_ids  # noqa: E402
from tests.json_schemas import random_instance, random_schema  # noqa: E402

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


def measure(lib_cls, tokenizer_json: str, eos: int, schemas: list[dict], streams: list[list[int]],
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--schemas", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=LLAMA3_VOCAB, help="the synthesized tokenizer's exact size")
    ap.add_argument("--libs", default=",".join(LIBS), help=f"comma-separated, from {LIBS}")
    args = ap.parse_args()
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
    results = {name: measure(classes[name], tokenizer_json, eos, schemas, streams, args.steps, args.batch)
               for name in libs}
    both = len(libs) == 2
    ratio = f"{libs[0][:3]}/{libs[1][:3]}" if both else ""
    print(f"{'':18}" + "".join(f"{name:>12}" for name in libs) + f"{ratio:>10}")
    for k in results[libs[0]]:
        row = [results[name][k] for name in libs]
        print(f"{k:18}" + "".join(f"{v:12.3f}" for v in row) + (f"{row[0] / row[1]:10.2f}" if both else ""))


if __name__ == "__main__":
    main()
