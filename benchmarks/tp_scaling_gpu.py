"""Tensor-parallel scaling of the decode step on GPUs: `python benchmarks/tp_scaling_gpu.py --model /tmp/l8b`.

For TP = 1 and 2 (two GPUs), the engine's decode step (engine.step(), CUDA graphs capturing the all-reduces,
overlapped scheduling) at batch 1 (1k context) and batch 64 (2k context), each next to its floor measured in the
same run: rank 0's bytes per step (its shard of the weights and of the KV heads) / one GPU's copy bandwidth.
Then the scaling efficiency: (TP=1 step / TP=2 step) / 2 (1.0 = perfect).
`--compare-one-shot`: the TP=2 steps again with EngineConfig.tp_all_reduce "one_shot", and the speedup over NCCL.
`--all-reduce` / `--all-reduce-only`: the all-reduces a TP=2 decode step makes (2 per layer, batch x hidden bf16)
inside a CUDA graph through the engine's own TP groups, NCCL against the one-shot kernel
(engine.model.symmetric_all_reduce), and the peer copy of the same bytes (a lower bound on any one-shot sum).
`--only-tp 2 --load-format dummy` serves a model too large for one GPU (the Llama-3-70B shape).
"""

from __future__ import annotations

import argparse
import gc
import json
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.engine_bench_gpu import Bench, ceilings


def decode_steps(model: str, tp: int, bandwidth: float, flops: float, kv_gib: float, load_format: str,
                 cases: list[tuple[int, int]], all_reduce: str = "nccl") -> dict:
    bench = Bench(model, bandwidth, flops, int(kv_gib * (1 << 30)), tensor_parallel_size=tp,
                  load_format=load_format, tp_all_reduce=all_reduce)
    try:
        one_shot = tp > 1 and bench.engine.followers.tp.one_shot is not None
        out = {}
        for batch, context in cases:
            row = bench.decode(batch, context)
            row["tp"] = tp
            if tp > 1:
                row["all_reduce"] = "one-shot <= 1 MiB, NCCL above" if one_shot else "NCCL"  # as configured
            print(json.dumps(row), flush=True)
            out[batch] = row
        return out
    finally:
        bench.engine.close()
        del bench
        gc.collect()
        torch.cuda.empty_cache()


def all_reduce_vs_peer_copy(hidden: int, layers: int) -> list[dict]:
    """Microseconds per all-reduce of a decode step's message (batch x hidden, bf16) on 2 GPUs inside a CUDA
    graph, as a decode step makes 2 per layer: the engine's TPGroup with every sum on NCCL against one with
    tp_all_reduce "one_shot" (engine.model.symmetric_all_reduce), at batch 1, 16 and 64; at batch 1 also the peer
    copy of the same bytes alone (a lower bound on any one-shot all-reduce)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    from engine.runner.tp_follower import host_store
    server, address = host_store(2, "pdserve-tp-scaling")  # the ranks connect to this process's store
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, hidden, 2 * layers, address, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(60)
    rows = []
    for mine, theirs in zip(*results, strict=True):  # per batch: the slower rank's figure
        row = {"case": f"all-reduce of {mine['batch']} x {hidden} bf16, {2 * layers} per step"}
        row["nccl_graph_us"] = max(mine["nccl_us"], theirs["nccl_us"])
        if "one_shot_us" in mine and "one_shot_us" in theirs:
            row["one_shot_graph_us"] = max(mine["one_shot_us"], theirs["one_shot_us"])
            row["nccl_x_one_shot"] = round(row["nccl_graph_us"] / row["one_shot_graph_us"], 2)
            row["one_shot_equals_nccl"] = mine["equal"] and theirs["equal"]
            row["us_saved_per_step"] = round((row["nccl_graph_us"] - row["one_shot_graph_us"]) * 2 * layers, 1)
        else:
            row["one_shot"] = "over 1 MiB: NCCL"
        rows.append(row)
    try:
        copy_us = _peer_copy_us(hidden, 2 * layers)
        rows[0] |= {"peer_copy_graph_us": copy_us, "nccl_x_copy": round(rows[0]["nccl_graph_us"] / copy_us, 2)}
    except Exception as e:  # noqa: BLE001 - the collectives' figures stand without it
        rows[0]["peer_copy_error"] = str(e).splitlines()[0]
    return rows


def _peer_copy_us(hidden: int, count: int) -> float:
    """Microseconds per copy of `hidden` bf16 from GPU 1 into GPU 0, `count` copies in one graph. Both devices'
    current streams are side streams: a capture may not make the legacy default stream wait on it."""
    src = torch.randn(hidden, device="cuda:1", dtype=torch.bfloat16)
    dst = torch.empty(hidden, device="cuda:0", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    s0, s1 = torch.cuda.Stream(device=0), torch.cuda.Stream(device=1)
    with torch.cuda.stream(s1), torch.cuda.stream(s0):
        dst.copy_(src)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        with torch.cuda.graph(graph, stream=s0):
            for _ in range(count):
                dst.copy_(src)
        return _graph_us(graph, count)


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


def _all_reduce_rank(rank: int, hidden: int, count: int, address, queue) -> None:
    """One rank: the engine's own TP groups (engine.runner.tp_follower.open_group), NCCL and one-shot."""
    from engine.engine_config import EngineConfig
    from engine.runner.tp_follower import open_group
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    config = EngineConfig(device="cuda", dtype="bfloat16", tensor_parallel_size=2)
    nccl = open_group(replace(address, name=address.name + "-nccl"), rank, 2, device, config)
    one_shot = open_group(address, rank, 2, device, replace(config, tp_all_reduce="one_shot"))
    rows = []
    for batch in (1, 16, 64):
        gen = torch.Generator("cuda").manual_seed(rank)
        x = torch.randn(batch * hidden, device=device, dtype=torch.bfloat16, generator=gen)
        row = {"batch": batch, "nccl_us": _time_in_graph(lambda x=x: nccl.all_reduce(x), count, nccl)}
        if one_shot.one_shot.fits(x):
            a, b = x.clone(), x.clone()
            one_shot.all_reduce(a)
            nccl.all_reduce(b)
            row["equal"] = bool(torch.equal(a, b))
            row["one_shot_us"] = _time_in_graph(lambda x=x: one_shot.all_reduce(x), count, nccl)
        rows.append(row)
    queue.put(rows)
    one_shot.close()
    nccl.close()


def _time_in_graph(op, count: int, group) -> float:
    """Microseconds per op, `count` ops captured in one CUDA graph (replayed by both ranks in step)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        op()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(count):
                op()
    group.all_reduce(torch.zeros(1, device="cuda"))  # both ranks start timing together
    torch.cuda.synchronize()
    return _graph_us(graph, count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a checkpoint folder (its config.json sizes the all-reduce)")
    parser.add_argument("--hidden", type=int, help="with --all-reduce-only and no --model: the hidden size")
    parser.add_argument("--layers", type=int, help="with --all-reduce-only and no --model: the layer count")
    parser.add_argument("--kv-gib", type=float, default=32.0,
                        help="KV cache per rank (TP=1 at batch 64, 2k context on the 8B shape needs 17.7 GB)")
    parser.add_argument("--only-tp", type=int, default=None)
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    parser.add_argument("--cases", default="1:1024,64:2048", help="batch:context of each decode case")
    parser.add_argument("--all-reduce", action="store_true",
                        help="also time NCCL's all-reduce against a one-shot all-reduce and a peer copy")
    parser.add_argument("--all-reduce-only", action="store_true", help="only the all-reduce comparison")
    parser.add_argument("--compare-one-shot", action="store_true",
                        help="also run TP=2 with tp_all_reduce=one_shot and print the speedup over NCCL")
    args = parser.parse_args()
    if not args.model and not (args.all_reduce_only and args.hidden and args.layers):
        parser.error("--model is required (or --all-reduce-only with --hidden and --layers)")
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    if torch.cuda.device_count() < 2:
        parser.error("needs two CUDA devices")
    bandwidth, flops = ceilings()
    print(json.dumps({"device": torch.cuda.get_device_name(0), "copy_gb_per_s": round(bandwidth / 1e9, 1)}),
          flush=True)
    sizes = [] if args.all_reduce_only else [args.only_tp] if args.only_tp else [1, 2]
    steps = {tp: decode_steps(args.model, tp, bandwidth, flops, args.kv_gib, args.load_format, cases)
             for tp in sizes}
    if 2 in steps and args.compare_one_shot:  # the same TP=2 steps with small sums by the one-shot kernel
        one_shot = decode_steps(args.model, 2, bandwidth, flops, args.kv_gib, args.load_format, cases, "one_shot")
        for batch, _ in cases:
            t, t1 = steps[2][batch]["step_ms"], one_shot[batch]["step_ms"]
            print(json.dumps({"case": f"TP=2 decode batch {batch}: one-shot all-reduce vs NCCL",
                              "nccl_step_ms": t, "one_shot_step_ms": t1, "speedup": round(t / t1, 3)}), flush=True)
    if 1 in steps and 2 in steps:
        for batch, _ in cases:
            t1, t2 = steps[1][batch]["step_ms"], steps[2][batch]["step_ms"]
            print(json.dumps({"case": f"TP scaling, decode batch {batch}", "tp1_step_ms": t1, "tp2_step_ms": t2,
                              "speedup": round(t1 / t2, 3), "efficiency": round(t1 / t2 / 2, 3)}), flush=True)
    if not (args.all_reduce or args.all_reduce_only):
        return
    if args.model:
        config = json.loads((Path(args.model) / "config.json").read_text())
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    else:
        hidden, layers = args.hidden, args.layers
    for row in all_reduce_vs_peer_copy(hidden, layers):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
