"""capture_graph: the one way this engine captures a CUDA graph (decode, prefill and mixed-step graphs alike);
DeferredCaptures: which of a graph set's buckets are captured at start and which wait for later.

Captures made after the engine is serving (engine.runner.deferred_graphs) run between two steps on the engine
thread, while other threads (the KV agents) keep using the GPU: so a capture is thread-local (another thread's CUDA
calls neither break it nor are refused), and it neither synchronizes the device nor empties the allocator's caches
(torch.cuda.graph does both, and would drop the pinned host buffers the engine re-uses).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


def capture_graph(fn: Callable[[], T], pool: tuple,
                  stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run fn() once on a side stream (it compiles the kernels and settles the allocator), then capture it into a
    graph sharing memory `pool` (torch.cuda.graph_pool_handle()). Returns the graph and fn's output of the capture,
    whose tensors hold each replay's results. `stream`: warm up and capture there (a green context's stream, whose
    SMs the graph's kernels then keep: engine.runner.sm_lanes); None: a new side stream. Stream order puts both after
    the work queued on the current stream (and on `stream`) so far. The warm-up's freed blocks stay cached for that
    stream (nothing here empties the allocator's cache): captures in a row share one (DeferredCaptures.stream)."""
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


class DeferredCaptures(Generic[K]):
    """The buckets of one graph set: captured, waiting (`pending`, in the order they are captured later), or
    failed (a capture that ran out of memory: that bucket's steps run eagerly for good)."""

    def __init__(self, pending: list[K]) -> None:
        self.pending: list[K] = list(pending)
        self.failed: set[K] = set()
        self.pool: tuple | None = None  # the graph memory pool all of the set's graphs share
        self._stream: torch.cuda.Stream | None = None

    def memory_pool(self) -> tuple:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def stream(self) -> torch.cuda.Stream:
        """The side stream the set's captures and their warm-up runs share (one allocator cache for all of them)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def attempt(self, key: K, capture: Callable[[], object], what: str, instead: str) -> bool:
        """Run `capture` for bucket `key`; True if it succeeded. A capture that fails (out of memory, or another
        CUDA error while capturing) marks the bucket failed for good and is logged as `what` with where its steps
        run `instead`."""
        try:
            capture()
        except (torch.cuda.OutOfMemoryError, RuntimeError):
            self.failed.add(key)
            log.warning("%s: capture failed; %s", what, instead, exc_info=True)
            return False
        return True

    def take(self, key: K | None = None) -> K | None:
        """Remove and return `key` (or the next pending bucket) if it is pending."""
        if key is None:
            return self.pending.pop(0) if self.pending else None
        if key in self.pending:
            self.pending.remove(key)
            return key
        return None
