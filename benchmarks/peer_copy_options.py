"""Which way should scattered KV blocks cross NVLink? Compares, on two GPUs, for 128 MiB and 1 GiB of
Llama-3-8B-shaped blocks (2 MiB each, scattered ids on both sides):

- ceiling: one contiguous peer `copy_` of the same bytes (copy engine);
- staged: index_select gather on the source GPU -> one peer copy -> index_copy_ scatter (kvtransfer's old path);
- pull: engine.kernels.block_copy.copy_blocks, launched on the destination GPU, reading peer memory.

`python benchmarks/peer_copy_options.py [--ipc]`: with --ipc the source cache lives in another process and is
opened through CUDA IPC, as kvtransfer's cuda_ipc backend does. Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.multiprocessing as mp

from engine.kernels.block_copy import copy_blocks

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ipc", action="store_true")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
