"""The measurements behind three design choices, each next to a ceiling measured in the same run (one JSON line per
measurement). Produces docs/benchmarks.md's "KV transfer between two GPUs" row for the copy kernel alone
(`peer-copy`), docs/kv_layout.md's table (`kv-layout`) and the figures engine/kernels/skinny_gemm.py cites
(`decode-kernels`, in docs/benchmark-log.md).

`python benchmarks/design_choices.py COMMAND [options]`:

- `decode-kernels [--sweep]` (one GPU; `bash benchmarks/gpu_run.sh kernels`, `KERNEL_ARGS=--sweep`): small-batch
  decode kernels, each next to the device copy bandwidth of the same run:
  the Llama-3-8B projections at M = 1, 2 and 8 rows: cuBLAS (F.linear) against engine.kernels.skinny_gemm with its
  own launch configuration, and with --sweep every configuration of a grid (to choose skinny_gemm.launch_config);
  decode attention at batch 1, 1k context, with the splits a graph of the engine gets (max model length 8192).
  Each figure times 32 calls on 32 different weights / KV layers (as one decode step meets them, so nothing is
  served from L2) captured in one CUDA graph: microseconds per call, and bytes moved per call / time as a fraction
  of copy bandwidth (a 2 GiB copy_ timed outside a graph: captured, it becomes a slower copy-engine memcpy node).
- `peer-copy [--ipc]` (two GPUs; `bash benchmarks/gpu_run.sh peer`): which way should scattered KV blocks cross
  NVLink? Compares, for 128 MiB and 1 GiB of Llama-3-8B-shaped blocks (2 MiB each, scattered ids on both sides):
  ceiling: one contiguous peer `copy_` of the same bytes (copy engine); staged: index_select gather on the source
  GPU -> one peer copy -> index_copy_ scatter (kvtransfer's old path); pull: engine.kernels.block_copy.copy_blocks,
  launched on the destination GPU, reading peer memory. With --ipc the source cache lives in another process and is
  opened through CUDA IPC, as kvtransfer's cuda_ipc backend does.
- `kv-layout` (the CPU): what chose the KV layout. Compares, for a Llama-3-8B-shaped cache (32 layers, 8 KV heads,
  head dim 128, 16-token blocks), block-major kv[blocks, layers, 2, 16, heads, dim] (pdserve's layout) and
  layer-major per layer kv[2, blocks, 16, heads, dim] (vLLM's usual layout) on (1) how many contiguous regions one
  request's KV spans after realistic allocator churn, which is the number of messages or copy descriptors a
  transfer needs, and (2) the time to pack one request's KV into a contiguous staging buffer on this machine,
  against a plain memcpy of the same bytes (the ceiling).

(Until f1a5769 these were three programs: decode_kernel_options.py, peer_copy_options.py, kv_layout.py.)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from engine.core.block_manager import BlockManager
from engine.kernels import skinny_gemm
from engine.kernels.block_copy import copy_blocks
from engine.kernels.decode_attention import decode_attention
from engine.kv_layout import block_runs

LAYERS = 32  # the Llama-3-8B shape's, in every study here
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SWEEP = {1: [(1, 2048, 4), (2, 2048, 4), (4, 2048, 4), (1, 4096, 4), (2, 4096, 4), (2, 4096, 8), (4, 4096, 8),
             (1, 8192, 8), (2, 8192, 8), (1, 16384, 8), (8, 1024, 4), (4, 1024, 4)],
         2: [(2, 4096, 4), (4, 2048, 4), (4, 4096, 8)],
         8: [(2, 4096, 4), (4, 2048, 4), (4, 4096, 8)]}


def graph_us(calls) -> float:
    """Median microseconds per call of a CUDA graph holding every call of `calls` (a list of thunks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def projections(bandwidth: float, sweep: bool) -> None:
    for name, (n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(LAYERS)]
        for m in (1, 2, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
            nbytes = n * k * 2
            cublas = [lambda w=w, x=x: F.linear(x, w) for w in weights]
            rows = [("cublas", None, graph_us(cublas))]
            default = skinny_gemm.launch_config(m, n, k)
            configs = SWEEP[m] if sweep else []
            for cfg in [default] + [c for c in configs if c != default]:
                skinny_gemm.launch_config = lambda m_, n_, k_, cfg=cfg: cfg
                calls = [lambda w=w, o=o, x=x: skinny_gemm.skinny_linear(x, w, out=o)
                         for w, o in zip(weights, outs, strict=True)]
                rows.append(("skinny", cfg, graph_us(calls)))
            skinny_gemm.launch_config = _default_config
            ref = F.linear(x, weights[0]).float()
            err = ((outs[0].float() - ref).norm() / ref.norm()).item()
            for kind, cfg, us in rows:
                print(json.dumps({"proj": name, "m": m, "kind": kind, "config": cfg, "us": round(us, 2),
                                  "gb_per_s": round(nbytes / us / 1e3, 1),
                                  "ratio": round(nbytes / us / 1e3 / (bandwidth / 1e9), 3)}), flush=True)
            print(json.dumps({"proj": name, "m": m, "skinny_rel_err_vs_cublas": round(err, 5)}), flush=True)
        del weights
        torch.cuda.empty_cache()


def attention(bandwidth: float, context: int = 1024, max_len: int = 8192) -> None:
    heads, kvh, d, bs = 32, 8, 128, 16
    nb = context // bs
    cache = torch.randn(nb + 1, LAYERS, 2, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    tables = torch.zeros(1, max_len // bs, dtype=torch.int32, device="cuda")
    tables[0, :nb] = torch.randperm(nb, device="cuda").to(torch.int32)
    lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    q = torch.randn(1, heads, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    sem = torch.zeros(1, kvh, dtype=torch.int32, device="cuda")
    us = graph_us([lambda i=i: decode_attention(q, cache[:, i], tables, lens, d ** -0.5, out=out, semaphores=sem)
                   for i in range(LAYERS)])
    nbytes = context * kvh * d * 2 * 2
    print(json.dumps({"attention": f"batch 1, {context} context, table width {max_len // bs}", "us": round(us, 2),
                      "gb_per_s": round(nbytes / us / 1e3, 1),
                      "ratio": round(nbytes / us / 1e3 / (bandwidth / 1e9), 3)}), flush=True)


_default_config = skinny_gemm.launch_config


def decode_kernels(args: argparse.Namespace) -> None:
    bandwidth = copy_bandwidth()
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_gb_per_s": round(bandwidth / 1e9, 1)}), flush=True)
    attention(bandwidth)
    projections(bandwidth, args.sweep)


BLOCK_SHAPE = (32, 2, 16, 8, 128)  # layers, K/V, block size, KV heads, head dim
NUM_BLOCKS = 1024
REPS = 20


def _time(fn, devices: list[int]) -> float:
    fn()
    for d in devices:
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    for _ in range(REPS):
        fn()
    for d in devices:
        torch.cuda.synchronize(d)
    return (time.perf_counter() - start) / REPS


def run_cases(src: torch.Tensor, dst: torch.Tensor, ipc: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    for n in (64, 512):
        run_size(src, dst, n, gen, ipc)


def run_ipc(remote: torch.Tensor, local: torch.Tensor) -> None:
    """remote: GPU 0's cache opened in GPU 1's context (labelled cuda:1). pull: GPU 1 reads it; push: GPU 1 writes
    it. The ceiling is a contiguous copy-engine peer copy GPU 0 -> GPU 1 of the same bytes."""
    gen = torch.Generator().manual_seed(1)
    for n in (64, 512):
        nbytes = n * local[0].numel() * local.element_size()
        a, b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0"), torch.empty(nbytes, dtype=torch.uint8,
                                                                                    device="cuda:1")
        ceiling = nbytes / _time(lambda: b.copy_(a), [0, 1]) / 1e9  # noqa: B023
        ids = torch.randperm(NUM_BLOCKS, generator=gen)[:n].to(local.device)
        ids2 = torch.randperm(NUM_BLOCKS, generator=gen)[:n].to(local.device)
        for case, (src, dst) in {"pull": (remote, local), "push": (local, remote)}.items():
            secs = _time(lambda: copy_blocks(src, ids, dst, ids2), [0, 1])  # noqa: B023
            dst.index_fill_(0, ids2, 0)
            copy_blocks(src, ids, dst, ids2)
            torch.cuda.synchronize(1)
            correct = bool(torch.equal(dst[ids2].cpu(), src[ids].cpu()))
            gbps = nbytes / secs / 1e9
            print(json.dumps({"case": case, "ipc": True, "blocks": n, "bytes": nbytes, "ms": round(secs * 1e3, 3),
                              "gb_per_s": round(gbps, 1), "ceiling_gb_per_s": round(ceiling, 1),
                              "ratio": round(gbps / ceiling, 3), "correct": correct}), flush=True)


def run_size(src: torch.Tensor, dst: torch.Tensor, n: int, gen: torch.Generator, ipc: bool) -> None:
    s, d = src.device.index, dst.device.index
    nbytes = n * src[0].numel() * src.element_size()
    src_ids = torch.randperm(NUM_BLOCKS, generator=gen)[:n]
    dst_ids = torch.randperm(NUM_BLOCKS, generator=gen)[:n]
    flat_src, flat_dst = src.view(-1)[: nbytes // 2], dst.view(-1)[: nbytes // 2]
    stage_s = torch.empty((n, *BLOCK_SHAPE), dtype=src.dtype, device=src.device)
    stage_d = torch.empty((n, *BLOCK_SHAPE), dtype=dst.dtype, device=dst.device)
    ids_on = {dev: (src_ids.to(f"cuda:{dev}"), dst_ids.to(f"cuda:{dev}")) for dev in {s, d}}

    def staged() -> None:
        with torch.cuda.device(s):
            torch.index_select(src, 0, ids_on[s][0], out=stage_s)
        stage_d.copy_(stage_s)
        dst.index_copy_(0, ids_on[d][1], stage_d)

    def pull() -> None:
        with torch.cuda.device(d):
            copy_blocks(src, ids_on[d][0], dst, ids_on[d][1])

    cases = {"ceiling": lambda: flat_dst.copy_(flat_src), "staged": staged, "pull": pull}
    ceiling = None
    for name, fn in cases.items():
        dst.view(-1)[:1].fill_(0)
        secs = _time(fn, [s, d])
        gbps = nbytes / secs / 1e9
        ceiling = ceiling or gbps
        correct = None
        if name != "ceiling":
            dst.index_fill_(0, dst_ids.to(dst.device), 0)
            fn()
            torch.cuda.synchronize(d)
            correct = bool(torch.equal(dst[dst_ids.to(dst.device)].cpu(), src[src_ids.to(src.device)].cpu()))
        print(json.dumps({"case": name, "ipc": ipc, "blocks": n, "bytes": nbytes, "ms": round(secs * 1e3, 3),
                          "gb_per_s": round(gbps, 1), "ceiling_gb_per_s": round(ceiling, 1),
                          "ratio": round(gbps / ceiling, 3), "correct": correct}), flush=True)


def _owner(queue, done) -> None:
    from torch.multiprocessing.reductions import reduce_tensor
    src = torch.randn((NUM_BLOCKS, *BLOCK_SHAPE), device="cuda:0").to(torch.bfloat16)
    queue.put(reduce_tensor(src)[1])
    done.wait(600)


def peer_copy(args: argparse.Namespace) -> None:
    dst = torch.empty((NUM_BLOCKS, *BLOCK_SHAPE), dtype=torch.bfloat16, device="cuda:1")
    if not args.ipc:
        src = torch.randn((NUM_BLOCKS, *BLOCK_SHAPE), device="cuda:0").to(torch.bfloat16)
        dst[:1].copy_(src[:1])
        src[:1].copy_(dst[:1])  # torch enables peer access both ways on first use
        run_cases(src, dst, ipc=False)
        return
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    owner = ctx.Process(target=_owner, args=(queue, done), daemon=True)
    owner.start()
    try:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        from kvtransfer.backends.cuda_ipc import _DEVICE_ARG
        args = list(queue.get(timeout=120))
        src_ref = torch.empty(1, device="cuda:0")
        dst[:1].view(-1)[:1].copy_(src_ref.to(torch.bfloat16))  # peer access on, both ways
        args[_DEVICE_ARG] = 1  # opened in GPU 1's context, as kvtransfer's cuda_ipc backend does
        src = rebuild_cuda_tensor(*args)  # physically on GPU 0
        run_ipc(src, dst)
        del src
    finally:
        done.set()
        owner.join(30)


HEADS, DIM, BS = 8, 128, 16


def churn_runs(num_blocks: int = 4096, requests: int = 400, seed: int = 0) -> list[int]:
    """Runs of consecutive block ids per request, admitted while others finish in random order."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=False)
    live: list[str] = []
    runs = []
    for i in range(requests):
        while live and (rng.random() < 0.5 or not bm.allocate("probe", 1)):
            bm.free(live.pop(rng.randrange(len(live))))
        bm.free("probe")
        tokens = rng.randint(100, 4000)
        if bm.allocate(f"r{i}", tokens):
            live.append(f"r{i}")
            runs.append(len(block_runs(bm.table(f"r{i}"))))
    return runs


def pack_seconds(cache: torch.Tensor, ids: list[int], block_dim: int, reps: int = 3) -> float:
    """Copy the request's blocks run by run (one copy per contiguous region) into a staging buffer."""
    regions = [cache.narrow(block_dim, first, n) for first, n in block_runs(ids)]
    if block_dim:  # layer-major: every run is split across the layer and K/V dimensions
        regions = [r[layer, kv] for r in regions for layer in range(LAYERS) for kv in range(2)]
    staging = torch.empty(sum(r.numel() for r in regions), dtype=cache.dtype)
    best = float("inf")
    for _ in range(reps):
        start, offset = time.perf_counter(), 0
        for r in regions:
            staging[offset:offset + r.numel()].view_as(r).copy_(r)
            offset += r.numel()
        best = min(best, time.perf_counter() - start)
    return best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def kv_layout(args: argparse.Namespace) -> None:
    runs = sorted(churn_runs())
    median_runs = runs[len(runs) // 2]
    print(json.dumps({"measure": "regions_per_request", "requests": len(runs), "median_runs": median_runs,
                      "p90_runs": runs[int(0.9 * len(runs))], "block_major_regions": median_runs,
                      "layer_major_regions": median_runs * LAYERS * 2}))
    num_blocks, req_blocks = 1024, 64  # a 1k-token request in a 16k-token cache
    block_major = torch.randn(num_blocks, LAYERS, 2, BS, HEADS, DIM, dtype=torch.bfloat16)
    layer_major = block_major.permute(1, 2, 0, 3, 4, 5).contiguous()  # [L, 2, blocks, ...] = per-layer tensors
    nbytes = req_blocks * LAYERS * 2 * BS * HEADS * DIM * 2
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t_copy = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    start = 100
    for case, ids in (("median_churn", list(range(start, start + req_blocks))),
                      ("scattered", sorted(random.Random(1).sample(range(num_blocks), req_blocks)))):
        for name, t in (("block_major", pack_seconds(block_major, ids, 0)),
                        ("layer_major", pack_seconds(layer_major, ids, 2))):
            print(json.dumps({"measure": "pack_request", "case": case, "layout": name, "bytes": nbytes,
                              "seconds": round(t, 5), "gb_per_s": round(nbytes / t / 1e9, 2),
                              "memcpy_gb_per_s": round(nbytes / t_copy / 1e9, 2), "ratio": round(t_copy / t, 3)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("decode-kernels", help="small-batch decode kernels against cuBLAS (one GPU)")
    p.add_argument("--sweep", action="store_true", help="time every skinny_gemm configuration of the grid")
    p.set_defaults(run=decode_kernels)
    p = commands.add_parser("peer-copy", help="scattered KV blocks between two GPUs: staged against pulled")
    p.add_argument("--ipc", action="store_true")
    p.set_defaults(run=peer_copy)
    p = commands.add_parser("kv-layout", help="block-major against layer-major KV: regions and pack time (CPU)")
    p.set_defaults(run=kv_layout)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
