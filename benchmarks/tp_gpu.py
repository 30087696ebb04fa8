"""Tensor parallelism on two GPUs: the decode step's scaling and its all-reduces, and KV handed between engines of
different TP sizes. Produces docs/benchmarks.md's "Tensor parallelism" rows (the TP=1 / TP=2 and 70B decode steps,
the one-shot all-reduce, heterogeneous TP) and the "Engine, one GPU" TP=1 rows.

`python benchmarks/tp_gpu.py COMMAND [options]`:

- `scaling --model /tmp/l8b` (`bash benchmarks/gpu_run.sh tpscale`, `allreduce`, `oneshot`, `tp70b`): for TP = 1
  and 2 (two GPUs), the engine's decode step (engine.step(), CUDA graphs capturing the all-reduces, overlapped
  scheduling) at batch 1 (1k context) and batch 64 (2k context), each next to its floor measured in the same run:
  rank 0's bytes per step (its shard of the weights and of the KV heads) / one GPU's copy bandwidth. Then the
  scaling efficiency: (TP=1 step / TP=2 step) / 2 (1.0 = perfect).
  `--compare-one-shot`: the TP=2 steps again with EngineConfig.tp_all_reduce "one_shot", and the speedup over NCCL.
  `--all-reduce` / `--all-reduce-only`: the all-reduces a TP=2 decode step makes (2 per layer, batch x hidden bf16)
  inside a CUDA graph through the engine's own TP groups, NCCL against the one-shot kernel
  (engine.model.symmetric_all_reduce), and the peer copy of the same bytes (a lower bound on any one-shot sum).
  `--only-tp 2 --load-format dummy` serves a model too large for one GPU (the Llama-3-70B shape).
- `transfer --model /tmp/l1b` (`bash benchmarks/gpu_run.sh tptransfer`): heterogeneous tensor parallelism end to end
  on real NCCL and cuda_ipc: a prefill engine of TP=a hands its KV to a decode engine of TP=b through their
  WorkerAgents (what the pool workers run), for (a, b) = (2, 1) and (1, 2), with both engines sharing the two GPUs
  (each holds a fixed slice of memory). Greedy outputs must equal one TP=1 engine's; the program prints each
  layout's pull time and bytes next to the data moved per GPU. `--device cpu` with a tiny checkpoint: gloo + UCX,
  as a check. Each engine runs in its own process (as in serving); a TP engine's ranks 1.. are its followers (their
  agents start there: kvtransfer.worker_agents.RankAgents). The decode process sees its own GPU first and the
  peer's after it, so cuda_ipc can map the prefill ranks' caches.

(Until f1a5769 these were two programs: tp_scaling_gpu.py and tp_transfer_gpu.py.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

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


def scaling(args: argparse.Namespace) -> None:
    parser = args.parser
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


PROMPTS, PROMPT_LEN, TOKENS = 8, 1000, 32


def _engine(model: str, device: str, tp: int, name: str, kv_bytes: int):
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from kvtransfer import AgentConfig
    from kvtransfer.worker_agents import RankAgents, WorkerAgents
    agent_config = AgentConfig(backends=("cuda_ipc", "ucx") if device == "cuda" else ("ucx",))
    config = EngineConfig(model=model, device=device, tensor_parallel_size=tp, kv_cache_memory_bytes=kv_bytes,
                          max_num_batched_tokens=2048, max_num_seqs=16, enable_prefix_caching=False)
    engine = LLMEngine(config, RankAgents(name, tp, agent_config) if tp > 1 else None)
    return engine, WorkerAgents(name, agent_config, engine)


def _prefill_main(model, device, tp, kv_bytes, prompts, conn) -> None:
    from engine.core.sampling_params import SamplingParams
    engine, agents = _engine(model, device, tp, "prefill-0", kv_bytes)
    conn.send(agents.metadata())
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, prefill_only=True)
    done = {}
    while len(done) < len(prompts):
        for out in engine.step():
            done[out.request_id] = (out.new_token_ids[0], out.pinned_block_ids)
    conn.send(done)
    conn.recv()  # the decode side has the KV
    for rid in done:
        engine.release(rid)
    agents.close()
    engine.close()


def _decode_main(model, device, tp, kv_bytes, prompts, conn) -> None:
    from engine.core.sampling_params import SamplingParams
    engine, agents = _engine(model, device, tp, "decode-0", kv_bytes)
    peer = agents.add_peer(conn.recv())
    pinned = conn.recv()
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    reads, blocks_moved = [], 0
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        blocks = engine.reserve_blocks(f"r{i}", len(p))
        reads.append(agents.read(peer, pinned[f"r{i}"][1][:len(blocks)], blocks).future)
        blocks_moved += len(blocks)
    for r in reads:
        r.result(120)
    pull_s = time.perf_counter() - start
    conn.send("pulled")
    tokens = {f"r{i}": [pinned[f"r{i}"][0]] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_prefilled_request(f"r{i}", p, pinned[f"r{i}"][0], params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    conn.send({"tokens": [tokens[f"r{i}"] for i in range(len(prompts))], "pull_s": pull_s,
               "bytes_per_rank": blocks_moved * engine.kv_spec.block_bytes})
    agents.close()
    engine.close()


def _spawn(target, visible: str | None, args) -> tuple:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # the child's GPUs, its own first
    try:
        proc = ctx.Process(target=target, args=(*args, child), daemon=False)
        proc.start()
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    child.close()
    return proc, parent


def run_layout(model: str, device: str, prefill_tp: int, decode_tp: int, prompts, kv_bytes: int) -> dict:
    gpu = device == "cuda"
    # a TP=2 engine uses GPUs 0 and 1; a TP=1 engine the other side's second GPU, with its peer visible
    p_vis = ("0,1" if prefill_tp == 2 else "1,0") if gpu else None
    d_vis = ("0,1" if decode_tp == 2 else "1,0") if gpu else None
    prefill, p_conn = _spawn(_prefill_main, p_vis, (model, device, prefill_tp, kv_bytes, prompts))
    decode, d_conn = _spawn(_decode_main, d_vis, (model, device, decode_tp, kv_bytes, prompts))
    try:
        d_conn.send(p_conn.recv())     # prefill's GroupMetadata
        d_conn.send(p_conn.recv())     # its first tokens and pinned blocks
        p_conn.send(d_conn.recv())     # "pulled": release
        return d_conn.recv()
    finally:
        for proc in (prefill, decode):
            proc.join(120)
            if proc.is_alive():
                proc.kill()


def transfer(args: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams
    gen = torch.Generator().manual_seed(0)
    vocab = json.load(open(os.path.join(args.model, "config.json")))["vocab_size"]
    prompts = [torch.randint(3, vocab, (args.prompt_len + 17 * i,), generator=gen).tolist() for i in range(PROMPTS)]
    kv_bytes = int(args.kv_gib * (1 << 30))
    one = LLM(args.model, device=args.device, kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=False)
    want = [o.token_ids for o in one.generate(prompts, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                      ignore_eos=True))]
    del one
    if args.device == "cuda":
        torch.cuda.empty_cache()
    ok = True
    for prefill_tp, decode_tp in ((2, 1), (1, 2)):
        got = run_layout(args.model, args.device, prefill_tp, decode_tp, prompts, kv_bytes)
        same = got["tokens"] == want
        ok &= same
        print(json.dumps({"case": f"P TP={prefill_tp} -> D TP={decode_tp}", "device": args.device,
                          "outputs_equal_tp1": same, "prompts": PROMPTS, "pull_ms": round(got["pull_s"] * 1e3, 2),
                          "bytes_per_decode_rank": got["bytes_per_rank"],
                          "gb_per_s_per_rank": round(got["bytes_per_rank"] / got["pull_s"] / 1e9, 2)}), flush=True)
    raise SystemExit(0 if ok else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = commands.add_parser("scaling", help="the decode step at TP=1 against TP=2, and the all-reduces (2 GPUs)")
    p.add_argument("--model", help="a checkpoint folder (its config.json sizes the all-reduce)")
    p.add_argument("--hidden", type=int, help="with --all-reduce-only and no --model: the hidden size")
    p.add_argument("--layers", type=int, help="with --all-reduce-only and no --model: the layer count")
    p.add_argument("--kv-gib", type=float, default=32.0,
                   help="KV cache per rank (TP=1 at batch 64, 2k context on the 8B shape needs 17.7 GB)")
    p.add_argument("--only-tp", type=int, default=None)
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--cases", default="1:1024,64:2048", help="batch:context of each decode case")
    p.add_argument("--all-reduce", action="store_true",
                   help="also time NCCL's all-reduce against a one-shot all-reduce and a peer copy")
    p.add_argument("--all-reduce-only", action="store_true", help="only the all-reduce comparison")
    p.add_argument("--compare-one-shot", action="store_true",
                   help="also run TP=2 with tp_all_reduce=one_shot and print the speedup over NCCL")
    p.set_defaults(run=scaling, parser=p)
    p = commands.add_parser("transfer", help="KV from a TP=2 engine to a TP=1 one and back, outputs checked")
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--kv-gib", type=float, default=4.0, help="KV cache per rank")
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    p.set_defaults(run=transfer)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
