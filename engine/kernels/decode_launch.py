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
    off the kernel is the one before them, which benchmarks/fp8_gpu.py times as the reference."""
    block_n: int
    num_warps: int
    num_stages: int
    whole_tiles: bool = True
    v_words: bool = True


def launch_config(dtype: torch.dtype, head_dim: int, fp8_cache: bool) -> AttentionLaunch:
    """16-bit, D <= 128: 64 tokens per tile (16 KiB each of K and V
    in bf16 at D = 128), 4 warps, pipelined loads (sm_90 build: ~104 registers, 39 KiB shared memory, so ~4 programs
    per SM). An fp8 cache (widened to float16): 128-token tiles, the same bytes a tile as bf16's 64, on five stages:
    the sm_90 build then gives K and V two shared buffers each (three or four stages give one), so each program has
    two tiles in flight; its ~201 registers fit two programs a SM. On an H200 (`gpu_run.sh fp8attn`, f331708,
    median of 3): batch 64 / 2k 0.105 ms (1 split) against 0.115 for three stages' best (4 splits); 16 / 8k 0.104
    (2 splits) against 0.110. fp32 (ieee dots) and wider heads: 32-token tiles on 8 warps, which is what avoids
    register spills."""
    if interpreting():
        return AttentionLaunch(32, 4, 1)
    if dtype == torch.float32 or head_dim > 128:
        return AttentionLaunch(32, 8, 2)
    return AttentionLaunch(128, 4, 5) if fp8_cache else AttentionLaunch(64, 4, 3)


SPLIT_CHOICES = (1, 2, 4, 8, 16, 32, 64)  # every value default_num_splits can return


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device,
                       fp8_cache: bool = False) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe): enough programs to fill every SM (programs_per_sm),
    no more splits than table blocks, at most 64. Always a power of two (SPLIT_CHOICES): the count is a constexpr,
    so steps of any shape compile one of seven variants, which start-up compiles (engine.runner.warmup) instead of
    the first requests."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return num_splits_for(batch, num_kv_heads, max_blocks, sms, fp8_cache)


def programs_per_sm(fp8_cache: bool) -> int:
    """The programs a split count aims for per SM: ~2, what fits a SM at once (registers) for either cache. On an
    H200 (`bash benchmarks/gpu_run.sh fp8attn`): a bf16 cache at batch 64 / 2k context 1 split, 0.137 ms against
    0.149 with 4 splits; 16 / 8k: 4 splits, 0.140 against 0.150 with 16 (2026-12-02); an fp8 cache on its five
    stages (f331708) 64 / 2k: 1 split 0.105 ms, 2 splits 0.117, 4 0.119; 16 / 8k: 2 splits 0.104, 1 split 0.133,
    4 0.108-0.160 (noisy)."""
    return 2


def num_splits_for(batch: int, num_kv_heads: int, max_blocks: int, sms: int, fp8_cache: bool = False) -> int:
    """default_num_splits on a device of `sms` streaming multiprocessors. A bf16 cache rounds the splits that fill
    every SM up to a power of two; an fp8 cache rounds down (16 / 8k on an H200: 2 splits, not 4), as its two tiles
    in flight a program already keep HBM busy."""
    fill = programs_per_sm(fp8_cache) * sms / max(batch * num_kv_heads, 1)
    want = 1 << max(int(fill).bit_length() - 1, 0) if fp8_cache else triton.next_power_of_2(math.ceil(fill))
    cap = min(max(max_blocks, 1), SPLIT_CHOICES[-1])
    return min(want, 1 << (cap.bit_length() - 1))


def shuns_pdl(num_stages: int) -> bool:
    """Whether a launch of this many stages goes without programmatic dependent launch, which at <= 16 rows starts
    its programs early, where they wait. The five-stage build (an fp8 cache) holds ~73 KiB of shared memory a
    program: waiting early, it took a decode step of FP8 weights and fp8 KV at batch 16 / 8k context from 6.04 to
    7.01 ms on an H200 (`gpu_run.sh pdl`, 6caf790)."""
    return num_stages >= 5
