"""Transfer benchmark: `python benchmarks/kvtransfer_bench.py` prints one JSON line per case.

Two workers (`BenchWorker`: a KVAgent and a random bf16 cache each) in two processes (`--mode process`,
the CPU default) or two Ray actors with one GPU each (`--mode ray`, the GPU default). The reader pulls
(or the writer pushes) N blocks with the Llama-3-8B KV shape; each case reports the median of `--repeat`
transfers, whether the destination blocks equal the source bit for bit (sha256 on both sides, the
destination poisoned before each read), and the raw copy ceiling measured in the same run (GPU0 -> GPU1
`copy_` of the same bytes; on the CPU an in-process memcpy) with the ratio.

  python benchmarks/kvtransfer_bench.py                                    # CPU, two processes, small sizes
  python benchmarks/kvtransfer_bench.py --mode ray --device cuda --configs ucx-one,ucx-all,ipc-all

Produces docs/benchmarks.md's "KV transfer between two GPUs" rows (`bash benchmarks/gpu_run.sh transfer`, and the UCX
row); tests/test_kvtransfer_bench.py runs its CPU path.

`python benchmarks/kvtransfer_bench.py --pull-path [--tokens 2048,8192] [--repeat 20] [--waits future,event,thread]`
(`bash benchmarks/gpu_run.sh pullpath`; until f1a5769 its own program, pull_path_gpu.py):
where a serving KV pull's time goes (issue 13): the decode worker's cuda_ipc pull outside serving, stage by stage.

The decode side is an async Ray actor like DecodeWorker: it records a fence event on its stream (the booking's
launch fence), starts `KVAgent.read(..., ready=fence)` and waits for it on its event loop. Per `--tokens` (KV of
one prompt) it prints, p50 over `--repeat` pulls:
- `launch_ms`: until read() returned (plan, copy kernel queued);
- `gpu_ms`: the copy on the GPU alone (timing events on the transfer stream around the same pull);
- `total_ms` per wait, the pull as the caller sees it:
  `future` (today's serving: the agent's loop completes a future after a thread blocks in cudaEventSynchronize,
  then the actor's loop is woken), `event` (the actor's loop polls the copy's CUDA event itself, yielding between
  polls), `thread` (one executor thread of the actor's loop blocks on the event);
- each without and then with a busy thread in the actor that, like an engine's step thread, holds the GIL
  launching small kernels for a few ms, then waits on the GPU;
against the raw time of the same bytes at the GPU 0 -> GPU 1 copy rate measured in the same run.
Then `launch_stages`: the host time of each piece of a launch, p50 over `--repeat` (each alone, the GPU idle):
`plan` (plan_transfer: validate and chunk), `ids` (the block ids to the GPU), `kernel` (the copy_blocks launch,
ids ready), `ipc_launch` (CudaIpcPeer.launch: all of them plus the stream wait and the event), `read` (KVAgent.read:
that plus the agent's bookkeeping and its loop's task).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from typing import Any

from kvtransfer_bench_worker import BenchWorker, PullSide  # this folder: the script's own directory

from engine.kv_layout import KVCacheSpec

LLAMA3_8B = KVCacheSpec("llama-3-8b", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                        dtype="bfloat16")
CONFIGS = {  # name -> (agent backends, GPU visibility per worker; see bench_worker)
    "ucx-ray": (["ucx"], "ray"),
    "ucx-one": (["ucx"], "one"),
    "ucx-all": (["ucx"], "all"),
    "ipc-all": (["cuda_ipc", "ucx"], "all"),
}


class _ProcessHost:
    """A BenchWorker in a spawned process, called over a pipe (same interface as a Ray actor handle)."""

    def __init__(self, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, args), daemon=True)
        self._proc.start()

    def call(self, method: str, *args: Any, timeout: float = 600.0) -> Any:
        self._conn.send((method, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{method} did not answer in {timeout} s")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(value)
        return value

    def stop(self) -> None:
        try:
            self.call("close", timeout=30)
        finally:
            self._proc.kill()
            self._proc.join(10)


def _serve(conn: Any, args: tuple) -> None:
    w = BenchWorker(*args)
    while True:
        method, a = conn.recv()
        try:
            conn.send((True, getattr(w, method)(*a)))
        except Exception as e:  # noqa: BLE001 - reported to the driver
            conn.send((False, repr(e)))
        if method == "close":
            return


class _RayHost:
    def __init__(self, *args: Any) -> None:
        import ray

        self._ray = ray
        cls = ray.remote(num_gpus=1 if args[1] == "cuda" else 0, num_cpus=0)(BenchWorker)
        self._actor = cls.remote(*args)

    def call(self, method: str, *args: Any, timeout: float = 600.0) -> Any:
        return self._ray.get(getattr(self._actor, method).remote(*args), timeout=timeout)

    def stop(self) -> None:
        try:
            self.call("close", timeout=30)
        finally:
            self._ray.kill(self._actor)


def raw_copy_gbps(nbytes: int, device: str, repeat: int) -> float:
    """The ceiling in this run: GPU0 -> GPU1 copy_ of nbytes (CPU: one in-process memcpy)."""
    import torch

    if device == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").random_()
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    else:
        src = torch.empty(nbytes, dtype=torch.uint8).random_()
        dst = torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeat + 2):
        if device == "cuda":
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[2:]) / 1e9


def block_ids(n: int, total: int, pattern: str, rng: random.Random) -> list[int]:
    if pattern == "contiguous":
        start = rng.randrange(0, total - n + 1)
        return list(range(start, start + n))
    return rng.sample(range(total), n)


def run_config(args: argparse.Namespace, config: str, spec: KVCacheSpec, total_gpus: int) -> list[dict]:
    name, _, chunk = config.partition("@")
    chunk_mib = int(chunk) if chunk else args.chunk_mib  # 0: the agent's defaults
    backends, visible = CONFIGS[name] if args.device == "cuda" else (["ucx"], "all")
    host = _RayHost if args.mode == "ray" else _ProcessHost
    max_blocks = max(args.tokens) // spec.block_size
    num_blocks = max_blocks * 2  # room for scattered ids
    agent_cfg = {"backends": backends, "staging_bytes": max(chunk_mib << 22, max_blocks * spec.block_bytes)}
    if chunk_mib:
        agent_cfg.update(max_chunk_bytes=chunk_mib << 20, ucx_chunk_bytes=chunk_mib << 20)
    src = host("prefill", args.device, 0, total_gpus, visible)
    dst = host("decode", args.device, 1 % max(total_gpus, 1), total_gpus, visible)
    rows = []
    try:
        meta_src = src.call("setup", spec.to_dict(), num_blocks, 1, agent_cfg)
        meta_dst = dst.call("setup", spec.to_dict(), num_blocks, 2, agent_cfg)
        used = dst.call("add_remote", meta_src)
        src.call("add_remote", meta_dst)
        info = {"src": src.call("info"), "dst": dst.call("info"), "backend": used["prefill"]}
        print(json.dumps({"config": config, **info}), flush=True)
        rng = random.Random(0)
        for tokens in args.tokens:
            n = tokens // spec.block_size
            nbytes = n * spec.block_bytes
            ceiling = raw_copy_gbps(nbytes, args.device, args.repeat)
            for pattern in args.patterns:
                for op in args.ops:
                    s_ids = block_ids(n, num_blocks, pattern, rng)
                    d_ids = block_ids(n, num_blocks, pattern, rng)
                    if op == "read":
                        secs = dst.call("timed", "read", "prefill", d_ids, s_ids, args.repeat + args.warmup)
                    else:
                        dst.call("poison", d_ids)
                        secs = src.call("timed", "write", "decode", s_ids, d_ids, args.repeat + args.warmup)
                    sec = statistics.median(total for _, total in secs[args.warmup:])
                    submit = statistics.median(sub for sub, _ in secs[args.warmup:])
                    correct = src.call("digest", s_ids) == dst.call("digest", d_ids)
                    gbps = nbytes / sec / 1e9
                    row = {"config": config, "backend": info["backend"], "mode": args.mode,
                           "device": args.device, "op": op, "pattern": pattern, "tokens": tokens, "blocks": n,
                           "bytes": nbytes, "seconds": round(sec, 6),
                           "submit_ms": round(submit * 1e3, 3), "gbps": round(gbps, 2),
                           "correct": correct, "peer_copy_gbps": round(ceiling, 2),
                           "ratio": round(gbps / ceiling, 3)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        for mib in args.raw_ucx_mib:
            for fresh in (False, True):
                port = dst.call("raw_listen", mib << 20, args.repeat + 1, fresh)
                secs = src.call("raw_send", port, mib << 20, args.repeat + 1)
                sec = statistics.median(secs[1:])
                print(json.dumps({"config": config, "case": "raw-ucxx-tag-send", "fresh_recv_buffers": fresh,
                                  "bytes": mib << 20, "seconds": round(sec, 6),
                                  "gbps": round((mib << 20) / sec / 1e9, 2)}), flush=True)
        leaks = {"src": src.call("metrics")["staging_in_use"], "dst": dst.call("metrics")["staging_in_use"]}
        print(json.dumps({"config": config, "staging_in_use_after": leaks}), flush=True)
    finally:
        src.stop()
        dst.stop()
    return rows


def pull_path(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description="where a serving KV pull's time goes: the decode worker's cuda_ipc pull, "
                                "stage by stage (2 GPUs)")
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--waits", default="future,event,thread")
    args = p.parse_args(argv)
    import ray
    import torch

    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (os.path.dirname(here), here,
                                                             os.environ.get("PYTHONPATH")) if x)
    ray.init(include_dashboard=False, log_to_driver=True)
    total_gpus = torch.cuda.device_count()
    cls = ray.remote(num_gpus=1, num_cpus=0)(PullSide)
    spec = LLAMA3_8B
    tokens = [int(t) for t in args.tokens.split(",")]
    num_blocks = 2 * max(tokens) // spec.block_size
    cfg = {"backends": ["cuda_ipc", "ucx"], "staging_bytes": num_blocks * spec.block_bytes}
    src = cls.remote("prefill", "cuda", 0, total_gpus, "all")
    dst = cls.remote("decode", "cuda", 1, total_gpus, "all")
    meta_src = ray.get(src.setup.remote(spec.to_dict(), num_blocks, 1, cfg))
    meta_dst = ray.get(dst.setup.remote(spec.to_dict(), num_blocks, 2, cfg))
    print(json.dumps({"backend": ray.get(dst.add_remote.remote(meta_src)), "python": sys.version.split()[0]}))
    ray.get(src.add_remote.remote(meta_dst))
    rng = random.Random(0)
    for n_tok in tokens:
        n = n_tok // spec.block_size
        nbytes = n * spec.block_bytes
        raw_gbps = raw_copy_gbps(nbytes, "cuda", 10)
        raw_ms = nbytes / raw_gbps / 1e6
        s_ids, d_ids = rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n)
        for busy in (False, True):
            ray.get(dst.set_busy.remote(busy))
            for wait in args.waits.split(","):
                rows = ray.get(dst.pull.remote("prefill", d_ids, s_ids, args.repeat + 3, wait))[3:]
                launch, total, gpu = (statistics.median(r[i] for r in rows) * 1e3 for i in range(3))
                p90 = sorted(r[1] for r in rows)[int(0.9 * len(rows))] * 1e3
                print(json.dumps({"tokens": n_tok, "mib": round(nbytes / 2**20, 1), "busy": busy, "wait": wait,
                                  "launch_ms": round(launch, 3), "gpu_ms": round(gpu, 3),
                                  "total_ms": round(total, 3), "total_p90_ms": round(p90, 3),
                                  "raw_ms": round(raw_ms, 3), "raw_gbps": round(raw_gbps, 1),
                                  "total_x_raw": round(total / raw_ms, 2), "gpu_x_raw": round(gpu / raw_ms, 2)}),
                      flush=True)
        ray.get(dst.set_busy.remote(False))
        stages = ray.get(dst.launch_stages.remote("prefill", d_ids, s_ids, args.repeat))
        print(json.dumps({"tokens": n_tok, "launch_stages_ms": {k: round(v * 1e3, 3) for k, v in stages.items()}}),
              flush=True)
    correct = ray.get(src.digest.remote(s_ids)) == ray.get(dst.digest.remote(d_ids))
    print(json.dumps({"last_pull_correct": correct}))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--pull-path" in argv:  # the decode worker's cuda_ipc pull, stage by stage (2 GPUs)
        pull_path([a for a in argv if a != "--pull-path"])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["process", "ray"], default="process")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--configs", default="ipc-all", help=f"GPU only, comma list of {sorted(CONFIGS)}, "
                   "each optionally with @CHUNK_MIB, e.g. ipc-all@64")
    p.add_argument("--tokens", default=None, help="comma list (default: 256,1024 on cpu; 1024,8192 on cuda)")
    p.add_argument("--patterns", default="scattered,contiguous")
    p.add_argument("--ops", default="read,write")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunk-mib", type=int, default=0, help="0: AgentConfig defaults")
    p.add_argument("--raw-ucx-mib", default="", help="also time plain ucxx sends of these sizes (MiB)")
    args = p.parse_args(argv)
    args.raw_ucx_mib = [int(x) for x in args.raw_ucx_mib.split(",") if x]
    args.tokens = [int(t) for t in (args.tokens or ("1024,8192" if args.device == "cuda" else "256,1024"))
                   .split(",")]
    args.patterns = args.patterns.split(",")
    args.ops = args.ops.split(",")
    total_gpus = 0
    if args.device == "cuda":
        import torch

        total_gpus = torch.cuda.device_count()
    if args.mode == "ray":
        import os

        import ray

        # workers inherit the driver's environment: make this repository and this folder importable there
        here = os.path.dirname(os.path.abspath(__file__))
        paths = (os.path.dirname(here), here, os.environ.get("PYTHONPATH"))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        ray.init(include_dashboard=False, log_to_driver=True)
    configs = args.configs.split(",") if args.device == "cuda" else ["cpu"]
    for config in configs:
        try:
            run_config(args, config, LLAMA3_8B, total_gpus)
        except Exception as e:  # noqa: BLE001 - report and go on with the next configuration
            print(json.dumps({"config": config, "error": repr(e)}), flush=True)


if __name__ == "__main__":
    main()
