"""Moving whole KV blocks (or a layer range of each) between block-major caches and contiguous staging, for the
KV-transfer layer: gather (cache -> staging), scatter (staging -> cache) and copy (cache -> cache, scattered ids
on both sides), each one kernel launch.

With the layout of engine.kv_layout, layers [l0, l1) of one block are ONE contiguous run of
(l1 - l0) * 2 * bs * KVH * D elements, so a block is a single chunk: the kernel needs one block-id load per
program and no per-element index math. Data is moved as the widest integer word (int64/int32/int16) that divides
the chunk, the strides and every base address, so loads and stores become 16-byte vectors.

The source may live on another CUDA device than the destination (peer memory, e.g. a cache opened through CUDA
IPC): kernels run on the destination's device and pull over the link (peer access from the destination's device
must be enabled, as torch does at a pair's first peer copy). Block ids must be on that device. Ids
outside [0, num_blocks) are skipped (nothing read or written for that entry); repeated destination ids race, and
overlapping source and destination blocks of one cache are undefined.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from engine.kernels import check

# the kernel moves integer words, so any cache dtype copies bit for bit; fp8 is kv_cache_dtype fp8's (cuda_ipc moves
# those caches' blocks through copy_blocks)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
ID_DTYPES = (torch.int64, torch.int32)
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
BLOCK_BYTES = 16384  # bytes per program: 128 B (8 x 16-byte vectors) per thread at 4 warps, many loads in flight


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
    src_block_stride, src_offset, n_src_blocks,
    dst_block_stride, dst_offset, n_dst_blocks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr,
):
    # Grid (n, cdiv(CHUNK, BLOCK)): program (i, c) copies words [c * BLOCK, (c + 1) * BLOCK) of entry i's chunk,
    # from src block src_ids[i] (or i) to dst block dst_ids[i] (or i). Everything is in words; block offsets are
    # int64 (a cache spans more than 2^31 words). The only mask besides the chunk's tail is a uniform per-program
    # validity flag, so Triton keeps 16-byte vector accesses (strides/offsets are multiples of 16 words in
    # practice and are specialised as such).
    i = tl.program_id(0)
    c = tl.program_id(1)
    if SRC_INDEXED:
        sb = tl.load(src_ids_ptr + i).to(tl.int64)
    else:
        sb = i.to(tl.int64)
    if DST_INDEXED:
        db = tl.load(dst_ids_ptr + i).to(tl.int64)
    else:
        db = i.to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    # Ids as uniform blocks: the interpreter mistypes (scalar mask) & (block mask); the compiler folds the splat.
    sbv = tl.zeros([BLOCK], tl.int64) + sb
    dbv = tl.zeros([BLOCK], tl.int64) + db
    mask = (offs < CHUNK) & (sbv >= 0) & (sbv < n_src_blocks) & (dbv >= 0) & (dbv < n_dst_blocks)
    words = tl.load(src_ptr + sb * src_block_stride + src_offset + offs, mask=mask)
    tl.store(dst_ptr + db * dst_block_stride + dst_offset + offs, words, mask=mask)


def _check_cache(name: str, cache: torch.Tensor) -> None:
    check(name, cache, 6, DTYPES)
    if not cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {cache.stride()}")
    if cache.shape[2] != 2:
        raise ValueError(f"{name} must be [NB, L, 2, bs, KVH, D], got shape {tuple(cache.shape)}")


def _check_same_blocks(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")
    if tuple(t.shape[2:]) != tuple(ref.shape[2:]):
        raise ValueError(f"{name}'s block shape {tuple(t.shape[1:])} does not match {ref_name}'s "
                         f"{tuple(ref.shape[1:])}")


def _check_devices(src_name: str, src: torch.Tensor, dst_name: str, dst: torch.Tensor) -> None:
    if src.device != dst.device and not (src.is_cuda and dst.is_cuda):
        raise ValueError(f"{src_name} is on {src.device} and {dst_name} on {dst.device}: both must be on one device "
                         f"or both CUDA (peer access)")


def _check_ids(name: str, ids: torch.Tensor, device: torch.device, n: int | None = None) -> None:
    check(name, ids, 1, ID_DTYPES, device)
    if n is not None and ids.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {ids.shape[0]}")


def _layer_range(cache: torch.Tensor, layer_start: int, layer_end: int | None) -> tuple[int, int]:
    num_layers = cache.shape[1]
    l1 = num_layers if layer_end is None else layer_end
    if not 0 <= layer_start < num_layers:
        raise ValueError(f"layer_start must be in [0, {num_layers}), got {layer_start}")
    if not layer_start < l1 <= num_layers:
        raise ValueError(f"layer_end must be in ({layer_start}, {num_layers}], got {layer_end}")
    return layer_start, l1


def _word_bytes(*, sizes_bytes: tuple[int, ...], tensors: tuple[torch.Tensor, ...]) -> int:
    """Widest word size (8/4/2/1 bytes) dividing every size and every tensor's base address."""
    for w in (8, 4, 2, 1):
        if all(s % w == 0 for s in sizes_bytes) and all(t.data_ptr() % w == 0 for t in tensors):
            return w
    return 1


def _as_words(t: torch.Tensor, w: int) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat tensor of `w`-byte integers (a view)."""
    return t.reshape(-1).view(torch.uint8).view(_WORDS[w])


def _launch(src: torch.Tensor, src_ids: torch.Tensor | None, src_block: int, src_offset: int,
            dst: torch.Tensor, dst_ids: torch.Tensor | None, dst_block: int, dst_offset: int,
            n: int, chunk: int) -> None:
    """Copy n chunks of `chunk` elements: entry i from src[ids or i] to dst[ids or i]; block strides and
    offsets in elements of the (shared) dtype; src's and dst's leading dim is the block index."""
    if n == 0:
        return
    itemsize = src.element_size()
    w = _word_bytes(sizes_bytes=tuple(x * itemsize for x in (chunk, src_block, src_offset, dst_block, dst_offset)),
                    tensors=(src, dst))

    def words(elements: int) -> int:
        return elements * itemsize // w

    chunk_w = words(chunk)
    block = min(BLOCK_BYTES // w, triton.next_power_of_2(chunk_w))
    grid = (n, triton.cdiv(chunk_w, block))
    any_ids = src_ids if src_ids is not None else dst_ids
    ctx = torch.cuda.device(dst.device) if dst.is_cuda else contextlib.nullcontext()
    with ctx:
        _copy_blocks_kernel[grid](
            _as_words(src, w), _as_words(dst, w),
            src_ids if src_ids is not None else any_ids, dst_ids if dst_ids is not None else any_ids,
            words(src_block), words(src_offset), src.shape[0],
            words(dst_block), words(dst_offset), dst.shape[0],
            CHUNK=chunk_w, BLOCK=block, SRC_INDEXED=src_ids is not None, DST_INDEXED=dst_ids is not None,
            num_warps=4,
        )


def _block_geometry(cache: torch.Tensor, l0: int, l1: int) -> tuple[int, int, int]:
    """(elements per block, element offset of layer l0 in a block, elements of layers [l0, l1) of a block)."""
    layer = math.prod(cache.shape[2:])
    return cache.shape[1] * layer, l0 * layer, (l1 - l0) * layer


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor, layer_start: int = 0,
                  layer_end: int | None = None) -> torch.Tensor:
    """out[i] = cache[block_ids[i], layer_start:layer_end] for every i; returns out.
    cache [NB, L, 2, bs, KVH, D] contiguous; block_ids [n] int64/int32 on out's device;
    out [n, l1 - l0, 2, bs, KVH, D] contiguous (may be on another CUDA device than cache)."""
    _check_cache("cache", cache)
    l0, l1 = _layer_range(cache, layer_start, layer_end)
    _check_ids("block_ids", block_ids, out.device)
    n = block_ids.shape[0]
    want = (n, l1 - l0, *cache.shape[2:])
    check("out", out, 6, (cache.dtype,))
    if tuple(out.shape) != want or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {want}, got shape {tuple(out.shape)} strides {out.stride()}")
    _check_devices("cache", cache, "out", out)
    block, offset, chunk = _block_geometry(cache, l0, l1)
    _launch(cache, block_ids, block, offset, out, None, chunk, 0, n, chunk)
    return out


def scatter_blocks(staging: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor, layer_start: int = 0,
                   layer_end: int | None = None) -> None:
    """cache[block_ids[i], layer_start:layer_end] = staging[i] for every i (the inverse of gather_blocks).
    staging [n, l1 - l0, 2, bs, KVH, D] contiguous (may be on another CUDA device than cache);
    cache [NB, L, 2, bs, KVH, D] contiguous; block_ids [n] int64/int32 on cache's device, no repeats."""
    _check_cache("cache", cache)
    l0, l1 = _layer_range(cache, layer_start, layer_end)
    _check_ids("block_ids", block_ids, cache.device)
    n = block_ids.shape[0]
    want = (n, l1 - l0, *cache.shape[2:])
    check("staging", staging, 6, (cache.dtype,))
    if tuple(staging.shape) != want or not staging.is_contiguous():
        raise ValueError(f"staging must be a contiguous {want}, got shape {tuple(staging.shape)} "
                         f"strides {staging.stride()}")
    _check_devices("staging", staging, "cache", cache)
    block, offset, chunk = _block_geometry(cache, l0, l1)
    _launch(staging, None, chunk, 0, cache, block_ids, block, offset, n, chunk)


def copy_blocks(src_cache: torch.Tensor, src_ids: torch.Tensor, dst_cache: torch.Tensor, dst_ids: torch.Tensor,
                layer_start: int = 0, layer_end: int | None = None) -> None:
    """dst_cache[dst_ids[i], layer_start:layer_end] = src_cache[src_ids[i], layer_start:layer_end] for every i.
    Both caches [NB?, L, 2, bs, KVH, D] contiguous with one per-block shape and dtype (block counts may differ);
    src_cache may be on another CUDA device than dst_cache; src_ids, dst_ids [n] int64/int32 on dst_cache's
    device."""
    _check_cache("src_cache", src_cache)
    _check_cache("dst_cache", dst_cache)
    _check_same_blocks("dst_cache", dst_cache, "src_cache", src_cache)
    if dst_cache.shape[1] != src_cache.shape[1]:
        raise ValueError(f"dst_cache has {dst_cache.shape[1]} layers, src_cache {src_cache.shape[1]}")
    _check_devices("src_cache", src_cache, "dst_cache", dst_cache)
    l0, l1 = _layer_range(dst_cache, layer_start, layer_end)
    _check_ids("src_ids", src_ids, dst_cache.device)
    _check_ids("dst_ids", dst_ids, dst_cache.device, src_ids.shape[0])
    block, offset, chunk = _block_geometry(dst_cache, l0, l1)
    _launch(src_cache, src_ids, block, offset, dst_cache, dst_ids, block, offset, src_ids.shape[0], chunk)
