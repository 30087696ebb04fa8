"""`BenchWorker`: one side of the transfer benchmark (a KVAgent plus a random cache), hosted in a spawned
process or a Ray actor by `benchmarks/kvtransfer_bench.py`; and `PullSide`, a BenchWorker whose pulls are awaited on
an asyncio loop, the decode side of `kvtransfer_bench.py --pull-path` (an async Ray actor, as the pool workers are).
A helper of kvtransfer_bench.py, not a program (its figures: docs/benchmarks.md's "KV transfer between two GPUs").

GPU visibility is set before CUDA starts in the hosting process (see `kvtransfer.gpu_visibility`):
`visible="ray"` leaves what Ray set (this actor's GPU only), `visible="one"` does the same by hand,
`visible="all"` shows every GPU of the host with this worker's own first, which the `cuda_ipc` backend
needs (the peer's GPU visible and reachable peer-to-peer). (Until f1a5769 PullSide was in pull_path_gpu.py.)
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import threading
import time
from typing import Any

from kvtransfer.gpu_visibility import own_gpu, set_visible_gpus


class BenchWorker:
    def __init__(self, name: str, device: str, gpu: int = 0, total_gpus: int = 1, visible: str = "all") -> None:
        if device == "cuda":
            set_visible_gpus(own_gpu(gpu), list(range(total_gpus)), visible)
        import torch

        self.torch = torch
        self.name = name
        self.device = torch.device("cuda:0" if device == "cuda" else "cpu")
        self.agent: Any = None
        self.kv: Any = None

    def setup(self, spec_dict: dict, num_blocks: int, seed: int, config: dict) -> bytes:
        from engine.kv_layout import KVCacheSpec
        from kvtransfer.agent import AgentConfig, KVAgent
        from kvtransfer.backends.ucx import use_python_futures

        torch = self.torch
        spec = KVCacheSpec.from_dict(spec_dict)
        g = torch.Generator(device=self.device).manual_seed(seed)
        bits = torch.randint(-(2**15), 2**15, spec.shape(num_blocks), generator=g, dtype=torch.int16,
                             device=self.device)
        self.kv = bits.view(torch.bfloat16)  # [num_blocks, L, 2, block, heads, dim]
        if config.get("backends"):
            config = {**config, "backends": tuple(config["backends"])}
        use_python_futures()  # as the pool workers (worker_setup.start_agent): no busy-polling thread hogs the GIL
        self.agent = KVAgent(self.name, AgentConfig(**config), address="127.0.0.1")
        self.agent.register_cache(self.kv, spec)
        return self.agent.metadata().to_bytes()

    def info(self) -> dict:
        torch = self.torch
        d: dict = {"pid": os.getpid(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
        try:
            import ucxx

            d["ucx_transports"] = sorted(ucxx.get_active_transports())
        except Exception as e:  # noqa: BLE001 - informational only
            d["ucx_transports"] = repr(e)
        if self.device.type == "cuda":
            n = torch.cuda.device_count()
            d["device_count"] = n
            d["peer_access"] = [torch.cuda.can_device_access_peer(0, i) for i in range(1, n)]
        return d

    def add_remote(self, meta: bytes) -> dict:
        self.agent.add_remote(meta)
        return self.agent.remotes()

    def poison(self, ids: list[int]) -> None:
        self.kv[ids] = float("nan")
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def timed(self, op: str, remote: str, local_ids: list[int], remote_ids: list[int], repeat: int,
              timeout: float = 60.0) -> list[tuple[float, float]]:
        """(seconds until read()/write() returned, seconds until done) of each of `repeat` transfers; the
        destination is poisoned before each, outside the timing."""
        times = []
        for _ in range(repeat):
            if op == "read":
                self.poison(local_ids)
            self._sync()
            t0 = time.perf_counter()
            if op == "read":
                handle = self.agent.read(remote, remote_ids, local_ids)
            else:
                handle = self.agent.write(remote, local_ids, remote_ids)
            t1 = time.perf_counter()
            handle.wait(timeout)
            times.append((t1 - t0, time.perf_counter() - t0))
        return times

    def digest(self, ids: list[int]) -> str:
        """sha256 of blocks `ids` (in this order), to compare the two sides bit for bit."""
        data = self.kv[ids].contiguous().view(self.torch.uint8).cpu().numpy()
        return hashlib.sha256(data.tobytes()).hexdigest()

    def metrics(self) -> dict:
        return self.agent.metrics()

    # ---- plain ucxx, no kvtransfer protocol: the reference for "UCX between Ray actors is slow" --------
    def _on_loop(self, coro: Any, timeout: float = 300.0) -> Any:
        from kvtransfer.loop import LoopThread

        if getattr(self, "_raw_loop", None) is None:
            self._raw_loop = LoopThread(f"{self.name}-raw")
        return self._raw_loop.call(coro, timeout)

    def raw_listen(self, nbytes: int, iters: int, fresh: bool) -> int:
        """Receive `iters` messages of nbytes; fresh=True: each into a new allocation kept alive (a new
        address, so UCX must open a new CUDA IPC mapping every time), else into one reused buffer."""
        import ucxx

        from kvtransfer.backends.ucx import as_ucx_buffer

        torch, dev = self.torch, self.device

        async def handler(ep: Any) -> None:
            keep = []
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            ack = torch.zeros(1, dtype=torch.uint8).numpy()
            for _ in range(iters):
                if fresh:
                    buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                    keep.append(buf)
                await ep.recv(as_ucx_buffer(buf), tag=7)
                await ep.send(ack, tag=8)

        async def start() -> int:
            self._raw_listener = ucxx.create_listener(handler)
            return int(self._raw_listener.port)

        return self._on_loop(start())

    def raw_send(self, port: int, nbytes: int, iters: int) -> list[float]:
        """Seconds of each send (until the receiver's ack) of one nbytes buffer to `raw_listen`."""
        import ucxx

        from kvtransfer.backends.ucx import as_ucx_buffer

        torch, dev = self.torch, self.device

        async def go() -> list[float]:
            ep = await ucxx.create_endpoint("127.0.0.1", port)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_()
            ack = torch.zeros(1, dtype=torch.uint8).numpy()
            self._sync()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                await ep.send(as_ucx_buffer(buf), tag=7)
                await ep.recv(ack, tag=8)
                times.append(time.perf_counter() - t0)
            await ep.close()
            return times

        return self._on_loop(go())

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if getattr(self, "_raw_loop", None) is not None:
            self._raw_loop.stop()
            self._raw_loop = None


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
