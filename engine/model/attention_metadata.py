"""What one step's attention reads, built once per step by the model runner: where each token's K/V goes in the
paged cache, what each token attends to, and (torch path) the step's masks and block lists, shared by every layer.
Plain dataclasses of tensors: the kernels (engine.kernels), the torch path (engine.model.torch_attention) and the
runner's graphs all read them; this module imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkPlan:
    """One prefill chunk: its rows among the step's tokens, the blocks of its context, its causal mask."""

    start: int
    length: int
    blocks: torch.Tensor        # [nb] int64
    mask: torch.Tensor | None   # [n, nb * bs] bool, True where the query may attend; None: plain causal from key 0


@dataclass(frozen=True)
class TorchAttentionPlan:
    """The step's attention inputs for the torch path, shared by every layer."""

    chunks: tuple[ChunkPlan, ...]
    decode_blocks: torch.Tensor | None  # [Bd * W] int64, the decode rows' block tables flattened
    decode_mask: torch.Tensor | None    # [Bd, 1, 1, W * bs] bool
    decode_kernel: bool = False         # the decode rows go to the C kernel (engine.cpu_kernels.paged_decode)
    # [C, 3] int32 (first row, length, context): the chunks go to engine.cpu_kernels.prefill_attention (then
    # `chunks` is empty); None: each chunk of `chunks` to SDPA
    prefill_chunks: torch.Tensor | None = None
    prefill_max_ctx: int = 0


@dataclass(frozen=True)
class AttentionMetadata:
    """Where the step's tokens go in the cache and what each one attends to. Built by the model runner."""

    slots: torch.Tensor                 # [T] int32, block id * block size + offset; negative = padding, not stored
    num_decode: int                     # the first num_decode tokens are single-token (decode) sequences
    decode_block_tables: torch.Tensor   # [Bd, W] int32, padded with 0
    decode_context_lens: torch.Tensor   # [Bd] int32, context including the new token; 0 = padding row
    prefill_block_tables: torch.Tensor  # [N, W] int32
    prefill_query_start: torch.Tensor   # [N + 1] int32, offsets of each chunk among the prefill tokens
    prefill_context_lens: torch.Tensor  # [N] int32, context including the chunk
    prefill_lens: tuple[tuple[int, int], ...]  # host copy of (chunk length, context length) per prefill sequence
    sliding_window: int | None
    decode_semaphores: torch.Tensor | None = None  # [>= Bd, KVH] int32 zeros the decode kernel may keep (graphs)
    torch_plan: TorchAttentionPlan | None = None  # torch path: the step's masks, built once

    @property
    def max_query_len(self) -> int:
        return max((n for n, _ in self.prefill_lens), default=0)
