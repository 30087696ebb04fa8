"""Calls from rank 0 to an object living in each tensor-parallel follower, beside the step stream.

Why: a follower holds its own shard of the KV cache, so whatever must act on that shard from outside the engine
(the KV transfer agent of a disaggregated worker: it registers the shard, connects to peers and pulls KV into it)
has to live in the follower's process. The engine does not know what that object is: its owner passes a
`RankServiceFactory` (picklable) to LLMEngine; each follower calls `prepare(device)` before CUDA starts and
`start(rank, kv_cache, kv_spec, kv_head_range)` once its cache exists, and the returned object's methods are then
called by name from rank 0 (`RankCalls.call(rank, method, *args)` -> a concurrent Future of the return value,
or of the exception it raised, re-raised in rank 0).

Calls travel on their own pipe per follower, answered by a thread pool in the follower, so a long call (a KV pull)
neither waits behind nor delays the model steps, and answers come back in any order (matched by call id).
Ownership: the service object belongs to its follower process and dies with it; a call pending when a follower
dies or the pipe closes fails with RankCallError.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec

if TYPE_CHECKING:
    import torch

CALL_THREADS = 8  # calls a follower runs at once (pulls of different requests overlap)


class RankServiceFactory(Protocol):
    def prepare(self, device: str) -> str:
        """In the follower, before CUDA starts; returns the device the rank should use (it may renumber)."""

    def start(self, rank: int, kv_cache: torch.Tensor, kv_spec: KVCacheSpec, kv_head_range: KVHeadRange,
              clock: Any) -> Any:
        """In the follower once its cache exists: the object whose methods rank 0 calls. `clock`: the follower's
        engine.runner.tp_follower.LaunchClock (how much of rank 0's device work it has launched)."""


class RankCallError(RuntimeError):
    """A call to a follower's service could not complete: the follower died or its pipe closed."""


class RankCalls:
    """Rank 0's side: one pipe per follower (rank 1.. in order), one reader thread per pipe."""

    def __init__(self, conns: list) -> None:
        self._conns = conns
        self._ids = itertools.count()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._readers = [threading.Thread(target=self._read, args=(rank, conn), daemon=True,
                                          name=f"pdserve-rank{rank}-calls")
                         for rank, conn in enumerate(conns, start=1)]
        for t in self._readers:
            t.start()

    def call(self, rank: int, method: str, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            call_id = next(self._ids)
            self._pending[call_id] = future
            try:
                self._conns[rank - 1].send((call_id, method, args))
            except (OSError, ValueError, BrokenPipeError) as e:
                self._pending.pop(call_id)
                future.set_exception(RankCallError(f"tensor-parallel rank {rank}: cannot call {method}: {e}"))
        return future

    def _read(self, rank: int, conn) -> None:
        try:
            while True:
                call_id, ok, value = conn.recv()
                with self._lock:
                    future = self._pending.pop(call_id, None)
                if future is not None:
                    (future.set_result if ok else future.set_exception)(value)
        except (EOFError, OSError):
            pass
        with self._lock:  # the follower is gone: nothing more will answer
            failed, self._pending = self._pending, {}
        for future in failed.values():
            future.set_exception(RankCallError(f"tensor-parallel rank {rank} stopped before answering"))


def serve_calls(conn, service: Any) -> threading.Thread:
    """The follower's side: answer rank 0's calls on `conn` with `service`'s methods until the pipe closes."""
    pool = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="pdserve-rank-call")
    send_lock = threading.Lock()

    def answer(call_id: int, method: str, args: tuple) -> None:
        try:
            reply = (call_id, True, getattr(service, method)(*args))
        except BaseException as e:  # the caller re-raises it in rank 0
            reply = (call_id, False, e)
        with send_lock:
            try:
                conn.send(reply)
            except (OSError, ValueError):
                pass  # rank 0 is gone
            except Exception as e:  # an unpicklable result or exception: say what it was
                conn.send((call_id, False, RankCallError(f"{method}: unsendable reply {reply[2]!r}: {e}")))

    def serve() -> None:
        try:
            while True:
                call_id, method, args = conn.recv()
                pool.submit(answer, call_id, method, args)
        except (EOFError, OSError):
            pool.shutdown(wait=False, cancel_futures=True)

    thread = threading.Thread(target=serve, daemon=True, name="pdserve-rank-calls")
    thread.start()
    return thread
