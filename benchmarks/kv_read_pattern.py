"""How fast the decode attention's read pattern alone can go on this GPU: a Triton kernel that reads a paged KV
cache (Llama-3-8B heads: 8 KV heads of 128, 16-token blocks, [NB, 2, bs, KVH, D]) through a block table exactly as
engine.kernels.decode_attention does, and only sums what it reads (as int32 words, no attention math), against the
copy bandwidth measured in the same run.

Two patterns per cache dtype: one program per KV head (the kernel's: each token gives a program one D-element row,
128 bytes in fp8 and 256 in bf16, rows 8 heads apart), and one program for all 8 heads of a span of tokens (each
token one contiguous KVH * D row, 1 KB in fp8), at the same bytes per tile and the same number of programs. If the
per-head pattern alone stays far under the copy rate in fp8 while all-heads does not, the fp8 cache's decode
attention is bound by its access pattern rather than by its arithmetic.

    python benchmarks/kv_read_pattern.py [--cases 64x2048,16x8000] (bash benchmarks/gpu_run.sh kvread)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.fp8_gpu import copy_bandwidth  # noqa: E402

KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 16
TILE_BYTES = 16384  # a tile's K bytes (the attention kernel's: 128 fp8 tokens or 64 bf16 tokens of one head)


@triton.jit
def _read_kernel(kv_ptr, tables_ptr, out_ptr, context, per_seq_blocks, stride_blk, stride_kv, stride_tok,
                 ROW_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 TOKENS_PER_PROG: tl.constexpr):
    group = tl.program_id(0)  # which ROW_WORDS-wide slice of a token's row (a KV head, or all of them)
    split = tl.program_id(1)
    b = tl.program_id(2)
    offs_w = tl.arange(0, ROW_WORDS)
    offs_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N, ROW_WORDS], tl.int32)
    start = split * TOKENS_PER_PROG
    for tile in range(start, tl.minimum(start + TOKENS_PER_PROG, context), BLOCK_N):
        toks = tile + offs_n  # [BLOCK_N]
        mask = toks < context
        blk = tl.load(tables_ptr + b * per_seq_blocks + toks // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
        row = blk * stride_blk + (toks % BLOCK_SIZE) * stride_tok + group * ROW_WORDS  # [BLOCK_N] in words
        k = tl.load(kv_ptr + row[:, None] + offs_w[None, :], mask=mask[:, None], other=0)
        v = tl.load(kv_ptr + stride_kv + row[:, None] + offs_w[None, :], mask=mask[:, None], other=0)
        acc += k ^ v
    tl.store(out_ptr + (b * tl.num_programs(1) + split) * tl.num_programs(0) + group, tl.sum(tl.sum(acc, 1), 0))


def read(words: torch.Tensor,   # [NB, 2, bs, KVH * D * elem / 4] int32 view of the cache
         tables: torch.Tensor, context: int, heads_per_program: int, splits: int) -> torch.Tensor:
    batch, per_seq = tables.shape
    row_words = words.shape[3] // KV_HEADS * heads_per_program
    block_n = TILE_BYTES // (row_words * 4)
    tokens_per_prog = triton.cdiv(triton.cdiv(context, splits), block_n) * block_n
    groups = KV_HEADS // heads_per_program
    out = torch.empty(batch * splits * groups, dtype=torch.int32, device=words.device)
    _read_kernel[(groups, splits, batch)](
        words, tables, out, context, per_seq, words.stride(0), words.stride(1), words.stride(2),
        ROW_WORDS=row_words, BLOCK_N=block_n, BLOCK_SIZE=BLOCK_SIZE, TOKENS_PER_PROG=tokens_per_prog,
        num_warps=4, num_stages=3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="64x2048,16x8000", help="comma-separated BATCHxCONTEXT")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this times a read pattern on a GPU")
    from triton.testing import do_bench
    bandwidth = copy_bandwidth()
    print(json.dumps({"case": "ceilings", "device": torch.cuda.get_device_name(),
                      "copy_gb_per_s": round(bandwidth / 1e9, 1)}), flush=True)
    for case in args.cases.split(","):
        batch, context = (int(v) for v in case.split("x"))
        per_seq = -(-context // BLOCK_SIZE)
        blocks = batch * per_seq + 8
        tables = torch.randperm(blocks - 8, device="cuda")[: batch * per_seq].view(batch, per_seq).to(torch.int32)
        for dtype, elem in (("fp8", 1), ("bf16", 2)):
            words = torch.randint(-2**31, 2**31 - 1, (blocks, 2, BLOCK_SIZE, KV_HEADS * HEAD_DIM * elem // 4),
                                  dtype=torch.int32, device="cuda")
            nbytes = batch * context * 2 * KV_HEADS * HEAD_DIM * elem
            base_splits = max(1, triton.next_power_of_2(triton.cdiv(8 * 132, batch * KV_HEADS)))
            variants = [(hp, s * (KV_HEADS // hp)) for hp in (1, KV_HEADS) for s in (base_splits // 2 or 1,
                                                                                     base_splits, base_splits * 2)]
            begin = time.perf_counter()
            while time.perf_counter() - begin < 1.0:  # clocks up before the first timing
                read(words, tables, context, 1, base_splits)
                torch.cuda.synchronize()
            times: dict = {}
            for _ in range(args.repeats):
                for hp, splits in variants:
                    times.setdefault((hp, splits), []).append(do_bench(
                        lambda hp=hp, splits=splits, w=words, t=tables, c=context: read(w, t, c, hp, splits),
                        warmup=5, rep=40,
                        return_mode="median"))
            for (hp, splits), runs in times.items():
                ms = statistics.median(runs)
                print(json.dumps({"pattern": "per KV head" if hp == 1 else "all KV heads", "cache": dtype,
                                  "batch": batch, "context": context, "programs": batch * splits * KV_HEADS // hp,
                                  "ms": round(ms, 4), "gb_per_s": round(nbytes / ms / 1e6, 1),
                                  "x_copy": round(nbytes / ms / 1e6 / (bandwidth / 1e9), 3)}), flush=True)


if __name__ == "__main__":
    main()
