"""What a worker reports about its engine (torch-free): WorkerInfo once at start, EngineLoad with every reply."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineLoad:
    queued_prompt_tokens: int  # prompt tokens admitted but not yet computed (waiting + running prefills)
    num_waiting: int
    num_running: int
    num_pinned: int            # prefill-only requests holding blocks until their KV is pulled
    free_blocks: int           # free + evictable cached
    total_blocks: int
    steps: int = 0


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    role: str  # "prefill" | "decode" | "collocated"
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    agent_metadata: bytes | None  # the worker's kvtransfer agent, serialized (None when it has none)
