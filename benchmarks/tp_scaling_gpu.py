"""Tensor-parallel scaling of the decode step on GPUs: `python benchmarks/tp_scaling_gpu.py --model /tmp/l8b`.

For TP = 1 and 2 (two GPUs), the engine's decode step (engine.step(), CUDA graphs capturing the all-reduces,
overlapped scheduling) at batch 1 (1k context) and batch 64 (2k context), each next to its floor measured in the
same run: rank 0's bytes per step (its shard of the weights and of the KV heads) / one GPU's copy bandwidth.
Then the scaling efficiency: (TP=1 step / TP=2 step) / 2 (1.0 = perfect). And the all-reduce a TP=2 decode step
makes twice per layer, at batch 1's size (hidden x bf16): NCCL's time inside a CUDA graph against the copy of
the same bytes from the peer GPU (the data movement alone a one-shot all-reduce would make, without its flags
or its add: a lower bound on its time).
`--only-tp 2 --load-format dummy` serves a model too large for one GPU (the Llama-3-70B shape).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.engine_bench_gpu import Bench, ceilings


def decode_steps(model: str, tp: int, bandwidth: float, flops: float, kv_gib: float, load_format: str,
                 cases: list[tuple[int, int]]) -> dict:
    bench = Bench(model, bandwidth, flops, int(kv_gib * (1 << 30)), tensor_parallel_size=tp,
                  load_format=load_format)
    try:
        out = {}
        for batch, context in cases:
            row = bench.decode(batch, context)
            row["tp"] = tp
            print(json.dumps(row), flush=True)
            out[batch] = row
        return out
    finally:
        bench.engine.close()
        del bench
        gc.collect()
        torch.cuda.empty_cache()


def all_reduce_vs_peer_copy(hidden: int, layers: int) -> dict:
    """Microseconds per all-reduce of one batch-1 hidden vector (bf16) on 2 GPUs, NCCL in a CUDA graph (as in a
    decode step: 2 per layer), against a peer copy of the same bytes in a graph."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = tempfile.mkdtemp(prefix="pdserve-tp-scaling-") + "/store"
    procs = [ctx.Process(target=_nccl_rank, args=(r, hidden, 2 * layers, store, queue)) for r in range(2)]
    for p in procs:
        p.start()
    nccl_us = max(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    src = torch.randn(hidden, device="cuda:1", dtype=torch.bfloat16)
    dst = torch.empty(hidden, device="cuda:0", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(0):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dst.copy_(src)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(2 * layers):
                    dst.copy_(src)
        copy_us = _graph_us(graph, 2 * layers)
    return {"case": f"all-reduce of {hidden} bf16 (batch 1), {2 * layers} per step", "nccl_graph_us": nccl_us,
            "peer_copy_graph_us": copy_us, "nccl_x_copy": round(nccl_us / copy_us, 2),
            "nccl_us_per_step": round(nccl_us * 2 * layers, 1)}


def _graph_us(graph: torch.cuda.CUDAGraph, per_replay: int, reps: int = 50) -> float:
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) * 1e3 / reps / per_replay, 2)


def _nccl_rank(rank: int, hidden: int, count: int, store_path: str, queue) -> None:
    import datetime

    import torch.distributed as dist
    torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120),
                            device_id=torch.device("cuda", rank))
    x = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dist.all_reduce(x)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(count):
                dist.all_reduce(x)
        dist.barrier()
        queue.put(_graph_us(graph, count))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-gib", type=float, default=12.0, help="KV cache per rank")
    parser.add_argument("--only-tp", type=int, default=None)
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--cases", default="1:1024,64:2048", help="batch:context of each decode case")
    parser.add_argument("--all-reduce", action="store_true", help="also time NCCL's all-reduce against a peer copy")
    args = parser.parse_args()
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    if torch.cuda.device_count() < 2:
        parser.error("needs two CUDA devices")
    bandwidth, flops = ceilings()
    print(json.dumps({"device": torch.cuda.get_device_name(0), "copy_gb_per_s": round(bandwidth / 1e9, 1)}),
          flush=True)
    sizes = [args.only_tp] if args.only_tp else [1, 2]
    steps = {tp: decode_steps(args.model, tp, bandwidth, flops, args.kv_gib, args.load_format, cases)
             for tp in sizes}
    if 1 in steps and 2 in steps:
        for batch, _ in cases:
            t1, t2 = steps[1][batch]["step_ms"], steps[2][batch]["step_ms"]
            print(json.dumps({"case": f"TP scaling, decode batch {batch}", "tp1_step_ms": t1, "tp2_step_ms": t2,
                              "speedup": round(t1 / t2, 3), "efficiency": round(t1 / t2 / 2, 3)}), flush=True)
    if not args.all_reduce:
        return
    config = json.loads((Path(args.model) / "config.json").read_text())
    print(json.dumps(all_reduce_vs_peer_copy(config["hidden_size"], config["num_hidden_layers"])), flush=True)


if __name__ == "__main__":
    main()
