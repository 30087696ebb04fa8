"""How engine.kernels.decode_attention's kernel is launched, from shapes alone (CUDA-graph safe): tokens a tile,
warps and pipeline stages (`AttentionLaunch`, `launch_config`), how many splits each sequence's context is cut into
(`default_num_splits`, `num_splits_for`), and whether programmatic dependent launch is used (`shuns_pdl`). Each
choice is from timings on an H200 or H100, named where it is made (docs/benchmark-log.md)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton

from engine.kernels import interpreting


class AttentionLaunch(NamedTuple):
    """How the kernel is launched: tokens a tile, warps, pipeline stages; `whole_tiles`: tiles wholly inside the
    context skip every mask (only the last is masked); `v_words` (fp8 caches): V read as int32 words and widened
    before tl.dot (engine.kernels.e4m3.widen_e4m3_words). Both are on in every launch the engine makes; with both
    off the kernel is the one before them, which benchmarks/fp8_gpu.py times as the reference. `lazy`: the online
    softmax's running max lags by up to 2^8 and acc is rescaled only when it moves that far (online_softmax); off:
    on an H100 it made the fp8 cache's batch-64 step 1% slower (benchmarks/attention_stages.py --lazy on).
    `swapped`: each tile's scores and the output are computed transposed (K . q^T, V^T . P^T: online_softmax), so the
    MMAs' 16-row side is the tile's tokens rather than a GQA group of 4-8 heads padded to 16."""
    block_n: int
    num_warps: int
    num_stages: int
    whole_tiles: bool = True
    v_words: bool = True
    lazy: bool = False
    swapped: bool = False


FEW_PAIRS = 64  # (sequence, KV head) pairs below which an fp8 cache takes the 4-warp launch
# launch_config's launches on a GPU (its docstring says why each) as AttentionLaunch's fields from the first
# (tokens a tile, warps, stages, ...): module constants, so that benchmarks/step_ab.py can time a decode step with
# others (--set "engine.kernels.decode_launch.FP8_LAUNCH=(32,1,3)")
BF16_LAUNCH = (64, 4, 3)
FP8_FEW_PAIRS_LAUNCH = (64, 4, 4)
FP8_LAUNCH = (32, 1, 5, True, True, False, True)
# the programs an fp8 cache's split count aims for per SM (programs_per_sm), as a constant for step_ab.py too
FP8_PROGRAMS_PER_SM = 8


def launch_config(dtype: torch.dtype, head_dim: int, fp8_cache: bool, pairs: int) -> AttentionLaunch:
    """The launch for a step of `pairs` (sequence, KV head) programs before splitting. 16-bit, D <= 128: 64 tokens
    a tile (16 KiB each of K and V in bf16 at D = 128), 4 warps, 3 stages (sm_90 build: 124 registers, 39 KiB of
    shared memory: 4 programs a SM). An fp8 cache (widened to float16) with many pairs: one warp a program on
    32-token tiles, swapped (K . q^T: the tile's tokens are the MMA's 16 rows), 5 stages (164 registers, 27 KiB:
    8 programs a SM, two tiles' copies in flight, no barrier between warps in the loop; on an H200 0.0803 ms at
    64 / 2k against the unswapped 4-stage launch's 0.0930, the step 1.07x faster, 440963f); with few (batch 1-7 at
    8 KV heads), 64-token tiles on 4 warps and 4 stages. On an H200 (`ATTN_ARGS="--cases
    64x2048,16x8000,1x1024 --graphs" bash benchmarks/gpu_run.sh fp8attn`, efc6d46, CUDA-graph replays), against
    the kernel before whole tiles and V words (128-token tiles on 4 warps, 5 stages) at its best split count:
    batch 64 / 2k 0.0932 ms (2 splits) against 0.0980, 16 / 8k 0.0909 (8 splits) against 0.0947, 1 / 1k 0.0053
    (64-token tiles) against 0.0073; one warp at 1 / 1k 0.0084 at best, 64-token tiles at 64 / 2k slower than
    0.11. fp32 (ieee dots) and wider heads: 32-token tiles on 8 warps, which is what avoids register spills."""
    if interpreting():
        return AttentionLaunch(32, 4, 1)
    if dtype == torch.float32 or head_dim > 128:
        return AttentionLaunch(32, 8, 2)
    if fp8_cache:
        return AttentionLaunch(*(FP8_FEW_PAIRS_LAUNCH if pairs < FEW_PAIRS else FP8_LAUNCH))
    return AttentionLaunch(*BF16_LAUNCH)


def launch_choices(dtype: torch.dtype, head_dim: int, fp8_cache: bool) -> tuple[AttentionLaunch, ...]:
    """Every launch launch_config picks for these, whatever the step's size (start-up compiles each)."""
    return tuple(dict.fromkeys(launch_config(dtype, head_dim, fp8_cache, pairs) for pairs in (1, FEW_PAIRS)))


SPLIT_CHOICES = (1, 2, 4, 8, 16, 32, 64)  # every value default_num_splits can return


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device,
                       fp8_cache: bool = False, tile_blocks: int = 1) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe): enough programs to fill every SM (programs_per_sm),
    no more splits than a table row has tiles (`tile_blocks` table blocks a tile), at most 64. Always a power of
    two (SPLIT_CHOICES): the count is a constexpr, so steps of any shape compile one of seven variants, which
    start-up compiles (engine.runner.warmup) instead of the first requests."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return num_splits_for(batch, num_kv_heads, max_blocks, sms, fp8_cache, tile_blocks)


def programs_per_sm(fp8_cache: bool) -> int:
    """The programs a split count aims for per SM. A bf16 cache: ~2 (H200, 2026-12-02: batch 64 / 2k 1 split,
    0.137 ms against 0.149 with 4; 16 / 8k 4 splits, 0.140 against 0.150 with 16). An fp8 cache: ~8, what its
    one-warp programs fit a SM (efc6d46, graphs: 64 / 2k 2 splits 0.0932 ms, 4 splits 0.0991, 8 0.1029; 16 / 8k
    8 splits 0.0909, 16 0.1027); at batch 1 the tile count caps it (64-token tiles at 1 / 1k: 16 splits)."""
    return FP8_PROGRAMS_PER_SM if fp8_cache else 2


def num_splits_for(batch: int, num_kv_heads: int, max_blocks: int, sms: int, fp8_cache: bool = False,
                   tile_blocks: int = 1) -> int:
    """default_num_splits on a device of `sms` streaming multiprocessors. A bf16 cache rounds the splits that fill
    every SM up to a power of two, an fp8 cache down; neither goes past the row's tiles (a split with no tile
    costs its launch: bf16 at batch 1 / 1k, 64 splits of which 16 busy 0.0068 ms against 16 splits' 0.0053)."""
    fill = programs_per_sm(fp8_cache) * sms / max(batch * num_kv_heads, 1)
    want = 1 << max(int(fill).bit_length() - 1, 0) if fp8_cache else triton.next_power_of_2(math.ceil(fill))
    cap = min(-(-max(max_blocks, 1) // max(tile_blocks, 1)), SPLIT_CHOICES[-1])
    return min(want, 1 << (cap.bit_length() - 1))


def shuns_pdl(launch: AttentionLaunch) -> bool:
    """Whether a launch goes without programmatic dependent launch, which at <= 16 rows starts its programs early,
    where they wait holding their shared memory. The five-stage build (an fp8 cache, ~73 KiB a program) took a
    decode step of FP8 weights and fp8 KV at batch 16 / 8k context from 6.04 to 7.01 ms on an H200 (`gpu_run.sh
    pdl`, 6caf790); the one-warp launch fits ~8 programs a SM, ~170 KiB together, so it goes without it too."""
    return launch.num_stages >= 5 or launch.num_warps == 1
