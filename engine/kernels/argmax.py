"""Each row's argmax of a logits matrix in two Triton launches (engine.sampling.sampler's greedy rows on CUDA).

Owns `row_argmax`: logits [S, V] float32 -> [S] int64, exactly torch's argmax(dim=-1): the first index of the
row's maximum, and a NaN counts as larger than every number (the first NaN's index wins). Why a kernel: torch
reduces a 128k-vocabulary row in one CUDA block, and the chunked torch reduction that replaced it took five launches
(max over chunks, argmax of the chunk maxima, a gather, a multiply, an add: ~19 us of kernels and their gaps after
an 8B decode step's LM head, traced on an H100). Here program (r, c) reduces chunk c of row r to (value, index), and
one program a row picks the first chunk holding the row's maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check

CHUNK = 4096  # vocabulary entries a program reduces: 32 programs a row for a 128k vocabulary
_NONE = 2**31 - 1  # an index larger than any (V < 2**31)


@triton.jit
def _first_max(x, idx, NONE: tl.constexpr):
    # x [N] float32 (padding -inf), idx [N] int32 (padding NONE) -> (value, index) of torch's argmax over them:
    # the first NaN if there is one, else the first maximum
    nan = x != x
    first_nan = tl.min(tl.where(nan, idx, NONE), 0)
    best = tl.max(tl.where(nan, float("-inf"), x), 0)
    first_best = tl.min(tl.where(x == best, idx, NONE), 0)
    has_nan = first_nan < NONE
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit(do_not_specialize=["V", "stride_l", "CHUNKS"])  # one variant whatever the rows' layout
def _chunk_argmax_kernel(logits_ptr, vals_ptr, idx_ptr, V, stride_l, CHUNKS, CHUNK: tl.constexpr,
                         NONE: tl.constexpr):
    # Grid (S, CHUNKS): program (r, c) writes chunk c's (value, index) of row r to vals / idx [S, CHUNKS]
    r = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    x = tl.load(logits_ptr + r.to(tl.int64) * stride_l + cols, mask=mask, other=float("-inf"))
    val, index = _first_max(x, tl.where(mask, cols, NONE), NONE)
    tl.store(vals_ptr + r * CHUNKS + c, val)
    tl.store(idx_ptr + r * CHUNKS + c, index)


@triton.jit(do_not_specialize=["CHUNKS"])
def _pick_kernel(vals_ptr, idx_ptr, out_ptr, CHUNKS, BLOCK_C: tl.constexpr, NONE: tl.constexpr):
    # Grid (S,): row r's argmax from its chunks' (value, index); chunk c's indices all precede chunk c + 1's, so
    # the first chunk holding the maximum (or a NaN) holds the first such index
    r = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < CHUNKS
    vals = tl.load(vals_ptr + r * CHUNKS + offs, mask=mask, other=float("-inf"))
    index = tl.load(idx_ptr + r * CHUNKS + offs, mask=mask, other=NONE)
    _, best = _first_max(vals, index, NONE)
    tl.store(out_ptr + r, best.to(tl.int64))


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [S, V] float32 (rows may be strided, columns contiguous) -> [S] int64, as logits.argmax(dim=-1)."""
    check("logits", logits, 2, (torch.float32,), inner_contiguous=True)
    rows, vocab = logits.shape
    if vocab == 0 or vocab >= _NONE:
        raise ValueError(f"row_argmax needs 0 < V < 2**31 columns, got {vocab}")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, CHUNK)
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, chunks)](logits, vals, idx, vocab, logits.stride(0), chunks, CHUNK=CHUNK,
                                         NONE=_NONE, num_warps=4)
    _pick_kernel[(rows,)](vals, idx, out, chunks, BLOCK_C=max(16, triton.next_power_of_2(chunks)), NONE=_NONE,
                          num_warps=1)
    return out
