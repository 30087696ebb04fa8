"""Where a serving KV pull's time goes (issue 13): the decode worker's cuda_ipc pull outside serving, stage by stage.

    python benchmarks/pull_path_gpu.py            # 2 GPUs: two Ray actors (async, as the pool workers), 8B KV shape

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
import asyncio
import json
import os
import random
import statistics
import sys
import threading
import time

from kvtransfer_bench import LLAMA3_8B, raw_copy_gbps  # this folder: the script's own directory
from kvtransfer_bench_worker import BenchWorker


class PullSide(BenchWorker):
    """A BenchWorker whose pulls are awaited on an asyncio loop (an async Ray actor, as the pool workers are)."""

    _busy_stop: threading.Event | None = None

    async def ping(self) -> int:
        return os.getpid()

    async def set_busy(self, on: bool, launches: int = 300) -> None:
        """Start (or stop) a thread that holds the GIL launching `launches` tiny kernels, then syncs, over and over."""
        if self._busy_stop is not None:
            self._busy_stop.set()
            self._busy_stop = None
        if not on:
            return
        stop = self._busy_stop = threading.Event()
        torch, device = self.torch, self.device

        def run() -> None:
            x = torch.zeros(16, device=device)
            with torch.cuda.device(device):
                while not stop.is_set():
                    for _ in range(launches):
                        x.add_(1.0)
                    torch.cuda.synchronize(device)
        threading.Thread(target=run, daemon=True, name="busy-step").start()

    async def pull(self, remote: str, local_ids: list[int], remote_ids: list[int], repeat: int,
                   wait: str) -> list[tuple[float, float, float]]:
        """(launch s, total s, gpu s) of `repeat` pulls, each awaited the `wait` way."""
        from kvtransfer.cache import event_done

        torch = self.torch
        ipc = self.agent._remotes[remote].ipc  # the transfer stream, to time the copy alone
        if ipc is None:
            raise RuntimeError(f"the agents chose {self.agent.remotes()[remote]!r}, not cuda_ipc: this program "
                               "times the cuda_ipc pull (both GPUs must be visible and peer-accessible)")
        out = []
        for _ in range(repeat):
            self.poison(local_ids)
            fence = torch.cuda.Event()
            fence.record(torch.cuda.current_stream(self.device))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(ipc._stream)
            t0 = time.perf_counter()
            handle = self.agent.read(remote, remote_ids, local_ids, ready=fence)
            t1 = time.perf_counter()
            end.record(ipc._stream)
            if wait == "future":
                await asyncio.wrap_future(handle.future)
            elif wait == "event":
                await event_done(handle._gpu_done, time.monotonic() + 60, spin_s=60)
            else:
                await asyncio.get_running_loop().run_in_executor(None, handle._gpu_done.synchronize)
            t2 = time.perf_counter()
            end.synchronize()
            await asyncio.wrap_future(handle.future)  # the metrics and the loop's bookkeeping, outside the timing
            out.append((t1 - t0, t2 - t0, start.elapsed_time(end) / 1e3))
        return out

    async def launch_stages(self, remote: str, local_ids: list[int], remote_ids: list[int],
                            repeat: int) -> dict[str, float]:
        """Median host seconds of each stage of a cuda_ipc read's launch (see the module docstring)."""
        from engine.kernels.block_copy import copy_blocks
        from kvtransfer.backends.cuda_ipc import _pinned
        from kvtransfer.head_slices import plan_transfer

        torch, agent = self.torch, self.agent
        r = agent._remotes[remote]
        ipc = r.ipc

        def plan() -> list:
            return plan_transfer("read", local_ids, remote_ids, None, None, agent._info, r.meta.cache, remote,
                                 agent.config.max_chunk_bytes)
        chunk = plan()[0]
        n = len(chunk.remote_ids)
        ids = _pinned(chunk.remote_ids + chunk.local_ids).to(self.device, non_blocking=True)

        def kernel() -> None:
            with torch.cuda.stream(ipc._stream):
                copy_blocks(ipc.remote.kv, ids[:n], ipc.local.kv, ids[n:], 0, None)
        stages = {"plan": plan,
                  "ids": lambda: _pinned(chunk.remote_ids + chunk.local_ids).to(self.device, non_blocking=True),
                  "kernel": kernel,
                  "ipc_launch": lambda: ipc.launch("read", [chunk], None),
                  "read": lambda: agent.read(remote, remote_ids, local_ids)}
        out = {}
        for name, fn in stages.items():
            times = []
            for _ in range(repeat + 3):
                torch.cuda.synchronize(self.device)
                t0 = time.perf_counter()
                result = fn()
                times.append(time.perf_counter() - t0)
                if name == "read":
                    await asyncio.wrap_future(result.future)
            torch.cuda.synchronize(self.device)
            out[name] = statistics.median(times[3:])
        return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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


if __name__ == "__main__":
    main()
