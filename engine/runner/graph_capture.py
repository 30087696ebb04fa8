"""capture_graph: the one way this engine captures a CUDA graph (decode, prefill and mixed-step graphs alike)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture_graph(fn: Callable[[], T], pool: tuple,
                  stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run fn() once on a side stream (it compiles the kernels and settles the allocator), then capture it into a
    graph sharing memory `pool` (torch.cuda.graph_pool_handle()). Returns the graph and fn's output of the capture,
    whose tensors hold each replay's results. `stream`: warm up and capture there (a green context's stream, whose
    SMs the graph's kernels then keep: engine.runner.sm_lanes); None: a side stream of the device's."""
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = fn()
    return graph, out
