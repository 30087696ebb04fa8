"""`BenchWorker`: one side of the transfer benchmark (a KVAgent plus a random cache), hosted in a spawned
process or a Ray actor by `benchmarks/kvtransfer_bench.py`.

GPU visibility is set before CUDA starts in the hosting process (see `kvtransfer.gpu_visibility`):
`visible="ray"` leaves what Ray set (this actor's GPU only), `visible="one"` does the same by hand,
`visible="all"` shows every GPU of the host with this worker's own first, which the `cuda_ipc` backend
needs (the peer's GPU visible and reachable peer-to-peer).
"""

from __future__ import annotations

import hashlib
import os
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

