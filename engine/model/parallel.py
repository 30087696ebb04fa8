"""Tensor parallelism of the decoder (Megatron-style): the TP group handle, how each rank's shard is cut, and the
vocabulary-parallel embedding.

Cut per rank r of N: q/k/v and gate/up are column-parallel (each rank holds its heads' rows and 1/N of the
intermediate rows, Qwen2's q/k/v biases with them); o and down are row-parallel (the matching input columns), each
followed by one all-reduce; a row-parallel bias is added once, after the reduce. Qwen3's q/k norms act per head
and are replicated. The embedding and the LM head are vocabulary-parallel: rank r holds rows
[r * ceil(V/N), (r + 1) * ceil(V/N)) (the last rank's tail padded with zeros); the embedding all-reduces, the LM
head all-gathers, so every rank ends with the full logits.
KV heads: with at least as many KV heads as ranks, each rank holds num_kv_heads / N of them; with fewer KV heads
than ranks, each KV head is replicated on N / num_kv_heads consecutive ranks (as vLLM does), so every rank finds
the KV head of its query heads locally, and each rank's cache holds one head.

How each rank's shard is cut is `engine.model.tp_layout.TPLayout` (pure arithmetic, no torch: the coordinator
checks a config with it). `TPGroup` wraps a standalone process group object (not registered with
torch.distributed's global state), so a process may hold several engines; TP=1 builds no group and the model runs
without any of this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from engine.model.fp8_linear import Fp8Linear


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of its tensor-parallel group; `pg` is a torch ProcessGroupGloo/NCCL object."""

    rank: int
    size: int
    pg: Any
    one_shot: Any = None  # engine.model.symmetric_all_reduce.OneShotAllReduce: small sums on CUDA, or None

    def all_reduce(self, x: torch.Tensor, op: Any = None) -> torch.Tensor:
        """Sum (or `op`) over the ranks, in place; returns x. Small sums take the one-shot kernel when the group
        has one (engine.model.symmetric_all_reduce), the rest NCCL or gloo."""
        if op is None and self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot.all_reduce(x)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM if op is None else op
        self.pg.allreduce([x], opts).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, n] per rank -> [S, size * n], rank r's columns at r * n."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([x], opts).wait()
        return x

    def close(self) -> None:
        """Tear this rank's side of the group down at once, without waiting for the peers (one may be gone).
        Left to garbage collection, an NCCL group whose peer had exited blocked its owner for the collective
        timeout (5 min) on two H200s."""
        if self.one_shot is not None:
            self.one_shot.close()
        self.pg.abort()

    def row_parallel(self, layer: nn.Linear | Fp8Linear, x: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """A row-parallel layer: partial products summed over the ranks, the bias added once after the sum.
        `out`: the partial product already computed (by a kernel) without the bias."""
        if out is not None:
            y = out
        elif isinstance(layer, Fp8Linear):
            y = layer.matmul(x)
        else:
            y = nn.functional.linear(x, layer.weight)
        self.all_reduce(y)
        return y if layer.bias is None else y + layer.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r's rows [start, start + rows) of the embedding; other ids give zeros, summed over the ranks."""

    def __init__(self, rows: int, hidden: int, start: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start, self.tp = start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden], identical on every rank."""
        local = input_ids.long() - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(x * inside[:, None].to(x.dtype))
