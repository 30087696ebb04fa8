"""`pdserve generate`: offline generation on one engine (the `pdserve` entry point is coordinator.cli)."""

from __future__ import annotations

import argparse
import sys

from engine.core.sampling_params import SamplingParams
from engine.llm import LLM


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete prompts offline on one engine")
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.add_argument("--model", default="tiny", help="'tiny' (built offline on first use) or a checkpoint folder")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens)
        llm = LLM(args.model, dtype=args.dtype, device=args.device)
    except (ValueError, OSError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outputs, strict=True):
        print(f"{prompt!r} -> {out.text!r}  [{len(out.token_ids)} tokens, {out.finish_reason}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
