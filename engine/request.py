"""Request: the engine's state for one request (tokens, progress, status). Owned by the scheduler.

Progress is one number, `num_computed_tokens`: how many of `all_token_ids` already have KV in the cache.
Each step computes `all_token_ids[num_computed_tokens:]` (or a chunk of it); when the chunk reaches the end,
a new token is sampled and appended. Prefill, chunked prefill, decode and recompute after preemption are
all this one rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, holds no blocks
    RUNNING = "running"      # holds blocks, scheduled every step
    PINNED = "pinned"        # prefill-only request done: blocks kept until released or lease expiry
    FINISHED = "finished"    # terminal; holds nothing


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability (of the unmodified distribution) and the top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: dict[int, float]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    prefill_only: bool = False
    all_token_ids: list[int] = field(init=False)  # prompt then outputs, appended in place (no copy per step)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    pin_deadline: float | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not yet computed (>= 1 while running)."""
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        self.finish_reason = self._stop_reason(token_id)

    def _stop_reason(self, token_id: int) -> str | None:
        p = self.params
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= self.max_model_len:
            return "length"
        return None
