"""Test helpers for kvtransfer: random KV caches and a KVAgent in another process, driven over a pipe.

`PeerProcess` runs a real KVAgent (real ucxx) in a spawned process with its own random cache; the test
process drives it (add_remote, read, write, blocks, metrics, ...) with a timeout on every call, and can
SIGSTOP / SIGCONT / SIGKILL it to make it stall or die mid-transfer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from typing import Any

import torch

from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec

SPEC = KVCacheSpec("kvtransfer-test", num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")


def random_cache(spec: KVCacheSpec, num_blocks: int, seed: int) -> torch.Tensor:
    """[num_blocks, L, 2, block, heads, dim] of random bit patterns (every bit matters, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, spec.shape(num_blocks), generator=g, dtype=torch.int16)
    return bits.view(torch.bfloat16)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Compare caches by their bits (bf16 NaN != NaN)."""
    return t.view(torch.int16)


def _peer_main(conn: Any, name: str, num_blocks: int, seed: int, config: dict, spec: KVCacheSpec,
               heads: KVHeadRange | None = None) -> None:
    from kvtransfer import AgentConfig, KVAgent

    agent = KVAgent(name, AgentConfig(**config), address="127.0.0.1")
    cache = random_cache(spec, num_blocks, seed)
    agent.register_cache(cache, spec, heads)
    conn.send(agent.metadata().to_bytes())
    while True:
        method, args = conn.recv()
        try:
            if method == "close":
                agent.close()
                conn.send(("ok", None))
                return
            if method == "blocks":
                result: Any = cache[list(args[0])].clone()
            elif method in ("read", "write"):
                getattr(agent, method)(*args[:-1]).wait(args[-1])
                result = None
            elif method == "notifications":
                result = agent.wait_notifications(args[0])
            else:
                result = getattr(agent, method)(*args)
            conn.send(("ok", result))
        except Exception as e:  # noqa: BLE001 - reported to the test process
            conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))


class PeerError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class PeerProcess:
    def __init__(self, name: str, num_blocks: int = 64, seed: int = 0, config: dict | None = None,
                 spec: KVCacheSpec = SPEC, wait: bool = True, heads: KVHeadRange | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.name = name
        self.seed = seed
        self.num_blocks = num_blocks
        self.proc = ctx.Process(target=_peer_main, args=(child, name, num_blocks, seed, config or {}, spec, heads),
                                daemon=True)
        self.proc.start()
        self.meta = b""
        if wait:
            self.ready()

    def ready(self, timeout: float = 90.0) -> PeerProcess:
        """Wait until the peer's agent is up and its metadata arrived (start several, then wait)."""
        if not self.meta:
            if not self._conn.poll(timeout):
                self.kill()
                raise TimeoutError(f"peer {self.name} did not start within {timeout} s")
            self.meta = self._conn.recv()
        return self

    def call(self, method: str, *args: Any, timeout: float = 60.0) -> Any:
        self._conn.send((method, args))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer {self.name}.{method} gave no answer within {timeout} s")
        status, result = self._conn.recv()
        if status == "err":
            raise PeerError(result[0], result[1] + "\n" + result[2])
        return result

    def wait_for(self, pred: Any, what: str, timeout: float = 30.0) -> Any:
        """Poll the peer's metrics until pred(metrics) holds (bounded); returns the last metrics."""
        end = time.monotonic() + timeout
        while True:
            m = self.call("metrics")
            if pred(m) or time.monotonic() > end:
                return m
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGSTOP, then wait until the kernel shows the process stopped: delivery is asynchronous, and a
        peer that runs on for a few milliseconds on a loaded machine would still serve the next request."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        end = time.monotonic() + 10.0
        while time.monotonic() < end:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
            time.sleep(0.001)
        raise RuntimeError(f"peer {self.proc.pid} did not stop within 10 s")

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.cont()
                self.call("close", timeout=20)
            except (TimeoutError, EOFError, BrokenPipeError, OSError, PeerError):
                pass
            self.proc.join(10)
        self.kill()


def wait_local(agent: Any, pred: Any, timeout: float = 30.0) -> dict:
    """Poll a local agent's metrics until pred holds (bounded); returns the last metrics."""
    end = time.monotonic() + timeout
    while True:
        m = agent.metrics()
        if pred(m) or time.monotonic() > end:
            return m
        time.sleep(0.05)


class AgentActor:
    """A KVAgent with a random cache, to host in a Ray actor (`ray.remote(AgentActor)`)."""

    def __init__(self, name: str, num_blocks: int, seed: int, config: dict | None = None) -> None:
        from kvtransfer import AgentConfig, KVAgent

        self.cache = random_cache(SPEC, num_blocks, seed)
        self.agent = KVAgent(name, AgentConfig(**(config or {})), address="127.0.0.1")
        self.agent.register_cache(self.cache, SPEC)

    def metadata(self) -> bytes:
        return self.agent.metadata().to_bytes()

    def add_remote(self, meta: bytes) -> str:
        """Connect, again after a PeerLost (a handshake that a loaded machine answered late), up to three times,
        as coordinator.backend.pools connects workers."""
        from kvtransfer.errors import PeerLost

        for attempt in range(3):
            try:
                return self.agent.add_remote(meta)
            except PeerLost:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def read(self, remote: str, remote_ids: list[int], local_ids: list[int], layers: Any = None,
             notify: bytes | None = None, timeout: float = 30.0) -> None:
        self.agent.read(remote, remote_ids, local_ids, layers=layers, notify=notify).wait(timeout)

    def write(self, remote: str, local_ids: list[int], remote_ids: list[int], layers: Any = None,
              notify: bytes | None = None, timeout: float = 30.0) -> None:
        self.agent.write(remote, local_ids, remote_ids, layers=layers, notify=notify).wait(timeout)

    def blocks(self, ids: list[int]) -> torch.Tensor:
        return self.cache[ids].clone()

    def notifications(self, count: int, timeout: float) -> dict[str, list[bytes]]:
        """Collect notifications until `count` arrived or `timeout` passed (messages can still be in
        flight when the transfers that sent them have finished)."""
        return collect_notifications(self.agent, count, timeout)

    def metrics(self) -> dict:
        return self.agent.metrics()

    def close(self) -> None:
        self.agent.close()


def collect_notifications(agent: Any, count: int, timeout: float) -> dict[str, list[bytes]]:
    got: dict[str, list[bytes]] = {}
    end = time.monotonic() + timeout
    while sum(map(len, got.values())) < count and time.monotonic() < end:
        for k, v in agent.wait_notifications(max(0.0, end - time.monotonic())).items():
            got.setdefault(k, []).extend(v)
    return got
