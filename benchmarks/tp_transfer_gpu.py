"""Heterogeneous tensor parallelism end to end on real NCCL and cuda_ipc: a prefill engine of TP=a hands its KV
to a decode engine of TP=b through their WorkerAgents (what the pool workers run), for (a, b) = (2, 1) and (1, 2),
with both engines sharing the two GPUs (each holds a fixed slice of memory). Greedy outputs must equal one TP=1
engine's; the program prints each layout's pull time and bytes next to the data moved per GPU.

    python benchmarks/tp_transfer_gpu.py --model /tmp/l1b                      # two GPUs
    python benchmarks/tp_transfer_gpu.py --model <tiny checkpoint> --device cpu  # gloo + UCX, as a check

Each engine runs in its own process (as in serving); a TP engine's ranks 1.. are its followers (their agents
start there: kvtransfer.worker_agents.RankAgents). The decode process sees its own GPU first and the peer's
after it, so cuda_ipc can map the prefill ranks' caches.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.multiprocessing as mp

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--kv-gib", type=float, default=4.0, help="KV cache per rank")
    parser.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
