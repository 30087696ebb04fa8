"""The decode step with the decode attention's pipeline stages changed, against the engine's own launches, in one
process (issue 42): `bash benchmarks/gpu_run.sh attnstages` (STAGES_ARGS="--stages fp8:5,bf16:5 ..."); or, with
`--early-kv off`, without the attention's early first tile against with it (early_kv_off); or, with `--max-splits
16,8,4`, with at most N splits a sequence against the engine's count, each N in a new engine (capped_splits); or, with
`--lazy on`, the lazy online softmax against the engine's exact one (lazy_softmax).

Why: Triton's pipeliner gives a load that sits behind another load in the loop (the K / V tile behind the block
table's ids) (num_stages - 1) // 2 stages of lead, so the engine's 4-stage fp8 launch and 3-stage bf16 launch
request each tile's K / V only after the tile before it is computed, and wait for it at once (docs/benchmark-log.md,
2026-12-05 evening). This times whole decode steps, not the kernel alone: each engine (FP8 weights + fp8 KV cache,
then bf16) runs the decode cases with engine.kernels.decode_launch's launches, then again, in a new engine, with
every launch it picks for that cache given the stage count asked for (tiles, warps and splits unchanged; a launch of
5 or more stages goes without programmatic dependent launch, as decode_launch.shuns_pdl says). Prints each engine's
rows and the ratio per case. The change is made by patching launch_config for the second engine only: the engine
itself has no such switch. Measured 2026-12-06 (docs/benchmark-log.md): 5 stages slower than the engine's 4 for an
fp8 cache (batch 64 / 2k 7.27 ms against 6.92 on an H200).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.fp8_gpu import checkpoint_args  # noqa: E402
from benchmarks.step_ab import against_the_engine  # noqa: E402
from engine.kernels import decode_launch  # noqa: E402
from engine.kernels.decode_launch import SPLIT_CHOICES, AttentionLaunch  # noqa: E402


def parse_stages(text: str) -> dict[str, int]:
    """"fp8:5,bf16:4" -> {"fp8": 5, "bf16": 4}; a clear error for anything else."""
    stages = {}
    for part in text.split(","):
        cache, _, value = part.partition(":")
        if cache not in ("fp8", "bf16") or not value.isdigit() or int(value) < 1:
            raise SystemExit(f"--stages: {part!r} is not CACHE:N with CACHE fp8 or bf16 and N >= 1")
        stages[cache] = int(value)
    return stages


def with_stages(launch_config: Callable[..., AttentionLaunch], cache: str, stages: int
                ) -> Callable[..., AttentionLaunch]:
    """launch_config, with every launch it picks for `cache` ("fp8" or "bf16") on `stages` pipeline stages."""
    def changed(dtype, head_dim, fp8_cache, pairs) -> AttentionLaunch:
        launch = launch_config(dtype, head_dim, fp8_cache, pairs)
        return launch._replace(num_stages=stages) if fp8_cache == (cache == "fp8") else launch
    return changed


def with_max_splits(num_splits_for: Callable[..., int], most: int) -> Callable[..., int]:
    """num_splits_for (decode_launch's), never above `most` splits a sequence."""
    def capped(*args, **kwargs) -> int:
        return min(num_splits_for(*args, **kwargs), most)
    return capped


def parse_split_caps(text: str) -> tuple[int, ...]:
    """"16,8" -> (16, 8): split counts the kernel can launch (decode_launch.SPLIT_CHOICES), or a clear error."""
    caps = tuple(int(part) if part.isdigit() else -1 for part in text.split(","))
    if any(cap not in SPLIT_CHOICES for cap in caps):
        raise argparse.ArgumentTypeError(f"{text!r}: each cap must be one of {SPLIT_CHOICES}")
    return caps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checkpoint_args(parser)
    mode = parser.add_mutually_exclusive_group()  # one comparison a run
    mode.add_argument("--stages", default="fp8:5", help="CACHE:N,... (fp8 and / or bf16)")
    mode.add_argument("--early-kv", choices=("off",), default=None,
                      help="instead of --stages: both caches' steps with decode_attention.EARLY_KV off against on")
    mode.add_argument("--max-splits", type=parse_split_caps, default=None,
                      help="N,...: instead of --stages, both caches' steps with at most N splits a sequence against "
                           "the engine's count, each N in a new engine")
    mode.add_argument("--lazy", choices=("on",), default=None,
                      help="instead of --stages: both caches' steps with the lazy online softmax against the exact one")
    args = parser.parse_args()
    if args.lazy:
        lazy_softmax(args)
        return
    if args.early_kv:
        early_kv_off(args)
        return
    if args.max_splits:
        capped_splits(args)
        return
    original = decode_launch.launch_config
    for cache, count in parse_stages(args.stages).items():
        changed = with_stages(original, cache, count)
        against_the_engine(args, [(f"attention on {count} stages vs the engine's launches",
                                   lambda changed=changed: launch_config_patches(changed))], only=cache)


def launch_config_patches(changed: Callable[..., AttentionLaunch]) -> list:
    """Patches putting `changed` in launch_config's place: decode_attention picks its launch through its own import
    of it, warm-up's launch_choices through decode_launch's; both see the change while an engine is built and timed."""
    return [mock.patch("engine.kernels.decode_launch.launch_config", changed),
            mock.patch("engine.kernels.decode_attention.launch_config", changed)]


def early_kv_off(args: argparse.Namespace) -> None:
    """What loading a slice's first tile before the PDL wait gains: each engine's decode cases, then again with the
    decode attention's early first tile off (decode_attention.EARLY_KV, read at each launch). It applies where the
    attention launches with PDL (bf16 at <= 16 rows, an fp8 cache at 1-7 rows), so the 64-row case is the control."""
    against_the_engine(args, [("attention without its early tile vs with",
                               lambda: [mock.patch("engine.kernels.decode_attention.EARLY_KV", False)])])


def lazy_softmax(args: argparse.Namespace) -> None:
    """What the lazy softmax (AttentionLaunch.lazy: acc rescaled only when the running max moves by 2^8) gains:
    each engine's decode cases, then again with every decode attention launch on it. Measured 2026-12-06 on an H100
    (docs/benchmark-log.md): 1% slower at batch 64 with an fp8 cache, within 0.4% elsewhere."""
    def lazy(dtype, head_dim, fp8_cache, pairs) -> AttentionLaunch:
        return original(dtype, head_dim, fp8_cache, pairs)._replace(lazy=True)
    original = decode_launch.launch_config
    against_the_engine(args, [("the lazy softmax vs the exact one", lambda: launch_config_patches(lazy))])


def capped_splits(args: argparse.Namespace) -> None:
    """Each engine's decode cases, then again, for each N of `--max-splits`, with the decode attention cutting each
    sequence into at most N slices. Why: a decode graph's split count follows its block table's width (the longest
    context it can hold), not the step's, so at batch 1 / 1k the engine launches 64 splits of which 16 find a tile
    (the kernel alone: 0.0068 ms against 0.0053 with 16, decode_launch.num_splits_for); caps of 8 and more change
    only the steps of few rows (batch 64 and 16 x 8k keep their 1-8): those are the control."""
    def patches(most: int) -> list:
        capped = with_max_splits(decode_launch.num_splits_for, most)
        # the kernel's default_num_splits calls num_splits_for in decode_launch; warm-up imported its own name
        return [mock.patch("engine.kernels.decode_launch.num_splits_for", capped),
                mock.patch("engine.runner.warmup.num_splits_for", capped)]
    against_the_engine(args, [(f"at most {most} splits vs the engine's count", lambda most=most: patches(most))
                              for most in args.max_splits])


if __name__ == "__main__":
    main()
