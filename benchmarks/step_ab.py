"""The decode step with engine constants changed, against the engine as it is, in one process (issue 42):
`python benchmarks/step_ab.py --bf16 DIR --fp8 DIR --set engine.kernels.fp8_quant.SPLIT_ROWS=64 [--set ...]`
(`bash benchmarks/gpu_run.sh stepab`, STEPAB_ARGS="--set ... [--only fp8] [--cases decode64,128x1024]"; each --set
is one variant: several names in one --set, apart by ";", change together).

Both engines (bf16; FP8 weights + fp8 KV), or the one --only names, run the decode cases of benchmarks/fp8_gpu.py
as they are, then once per variant in a new engine built and timed with the constants patched (against_the_engine,
which benchmarks/attention_stages.py's comparisons share), and print each ratio. A constant is patched where it is
defined, so it reaches the code that reads it as a global of its own module; a name that does not exist there is
refused before any engine is built.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.engine_bench_gpu import ceilings  # noqa: E402
from benchmarks.fp8_gpu import case_names, check_inputs, checkpoint_args, compare, measure  # noqa: E402

CASES = ("decode1", "decode64", "long")  # fp8_gpu.decode_case's names: batch 1 / 1k, 64 / 2k, 16 / 8k


def against_the_engine(args: argparse.Namespace, variants: list[tuple[str, Callable[[], list]]],
                       only: str | None = None, cases: tuple[str, ...] = CASES) -> None:
    """Both engines (bf16; FP8 weights + fp8 KV), or the one `only` names ("bf16", "fp8"), run the decode `cases`
    (fp8_gpu.decode_case's names) as they are, then, for each (label, patches) of `variants`, again in a new engine
    built and timed inside those patches; prints every row and each ratio."""
    check_inputs(args.bf16, args.fp8)
    bandwidth, flops = ceilings()
    kv_bytes = int(args.kv_gib * (1 << 30))
    engines = ((args.bf16, False, "auto"), (args.fp8, True, "fp8"))
    cases = list(cases)
    for folder, fp8, kv in (e for e in engines if only is None or (only == "fp8") == e[1]):
        base = measure(folder, fp8, bandwidth, flops, kv_bytes, args.load_format, cases, kv_cache_dtype=kv)
        for label, make_patches in variants:
            with contextlib.ExitStack() as stack:
                for patch in make_patches():
                    stack.enter_context(patch)
                new = measure(folder, fp8, bandwidth, flops, kv_bytes, args.load_format, cases, kv_cache_dtype=kv)
            for name in cases:
                compare(f"{'fp8' if fp8 else 'bf16'} cache, {label}, {base[name]['case']}", base[name], new[name])


def parse_setting(text: str) -> list[tuple[str, object]]:
    """"engine.x.NAME=64;engine.y.OTHER=True" -> [("engine.x.NAME", 64), ...]: each a module constant that exists,
    set to a Python literal; anything else an argparse error naming it."""
    settings = []
    for part in text.split(";"):
        target, sep, value = part.partition("=")
        module_name, _, name = target.strip().rpartition(".")
        if not sep or not module_name.startswith("engine.") or not name:
            raise argparse.ArgumentTypeError(f"{part!r}: expected engine.MODULE.NAME=VALUE")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise argparse.ArgumentTypeError(f"{part!r}: no module {module_name} ({e})") from None
        if not hasattr(module, name):
            raise argparse.ArgumentTypeError(f"{part!r}: {module_name} has no {name}")
        try:
            settings.append((target.strip(), ast.literal_eval(value.strip())))
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"{part!r}: {value!r} is not a Python literal") from None
    return settings


def parse_cases(text: str) -> tuple[str, ...]:
    """"decode64,128x1024" -> ("decode64", "128x1024"): decode cases only (a step's ratio; no prefill), or an
    argparse error naming the one it refuses."""
    return case_names(text, prefill=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_args(parser)
    parser.add_argument("--set", dest="variants", type=parse_setting, action="append", required=True,
                        help="engine.MODULE.NAME=VALUE[;...]: one variant (repeat for more)")
    parser.add_argument("--only", choices=("bf16", "fp8"), default=None, help="one engine (default: both)")
    parser.add_argument("--cases", type=parse_cases, default=CASES,
                        help="decode cases: decode1, decode64, long or BATCHxCONTEXT, comma-separated (default: "
                             f"{','.join(CASES)}; the engine takes the largest batch)")
    args = parser.parse_args()
    variants = [(", ".join(f"{target}={value!r}" for target, value in settings) + " vs as it is",
                 lambda settings=settings: [mock.patch(target, value) for target, value in settings])
                for settings in args.variants]
    against_the_engine(args, variants, args.only, args.cases)


if __name__ == "__main__":
    main()
