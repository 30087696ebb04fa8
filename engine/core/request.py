"""Request: the engine's state for one request (tokens, progress, status). Owned by the scheduler.

Progress is one number, `num_computed_tokens`: how many of `all_token_ids` already have KV in the cache.
Each step computes `all_token_ids[num_computed_tokens:]` (or a chunk of it); when the chunk reaches the end,
a new token is sampled and appended. Prefill, chunked prefill, decode and recompute after preemption are
all this one rule.

A resumed request (one migrated from another worker mid-stream) starts with `prior_output_ids`: outputs already
delivered elsewhere. They join `all_token_ids` (their KV is computed like the prompt's) and count as outputs, so the
next sampled token has output index len(prior_output_ids) (seeded sampling continues exactly) and max_tokens covers
them; stop checks only ever see newly sampled tokens.

A group prefill (n choices of one prompt, `fork_params` = the params of choices 1..n-1) samples every choice's
first token from the same logits row (`fork_first`) and stays pinned whatever those tokens are: each choice's end
is decided where it decodes (LLMEngine.add_prefilled_request). `prompt_logprobs` fills during prefill when
params.prompt_logprobs is set: one entry per prompt token after the first.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.sampling_params import SamplingParams


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


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's log-probability given the tokens before it, its rank in the vocabulary (1 = most likely)
    and the top alternatives (vLLM's prompt_logprobs)."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: dict[int, float]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    prefill_only: bool = False
    prior_output_ids: tuple[int, ...] = ()  # outputs already delivered before this request was (re)started here
    priority: int = 0  # scheduling order among waiting requests: lower first, arrival order within one priority
    # set by the scheduler as it takes the request: tells its chunks from those of an ended request of the same id
    # (a retry) that a step in flight or a prefill lane still computes
    incarnation: int = 0
    all_token_ids: list[int] = field(init=False)  # prompt then outputs, appended in place (no copy per step)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt (and prior output) tokens not computed at first admission: prefix-cache hits
    num_restored_tokens: int = 0  # ... of those, tokens whose KV was copied back from the host tier
    restore_timer: object | None = None  # its step's copies back (engine.runner.host_tier_store.CopyTimer)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    pin_deadline: float | None = None
    num_preemptions: int = 0
    swap_slots: list[int] | None = None  # while swapped out (waiting): the host slots holding its computed blocks
    first_scheduled_at: float | None = None  # scheduler clock: its first step (for per-request phase timings)
    fork_params: tuple[SamplingParams, ...] | None = None  # a group prefill: choices 1..n-1's first-token params
    fork_first: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # their first tokens
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)  # for prompt tokens 1.. (prefill)

    def __post_init__(self) -> None:
        self.prior_output_ids = tuple(self.prior_output_ids)
        self.all_token_ids = list(self.prompt_token_ids) + list(self.prior_output_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Every output: the prior ones, then those sampled here."""
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        """Outputs so far, prior ones included: the output index of the next token to sample."""
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def new_output_token_ids(self) -> list[int]:
        """Outputs sampled here (after the prior ones)."""
        return self.all_token_ids[len(self.prompt_token_ids) + len(self.prior_output_ids):]

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
        if self.fork_params is not None:
            return None  # a group prefill stays pinned: every choice ends where it decodes
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if self.num_output_tokens >= p.max_tokens or self.num_tokens >= self.max_model_len:
            return "length"
        return None


def validate_request(request_id: str, prompt: Sequence[int], params: SamplingParams, prior_output_ids: Sequence[int],
                     vocab_size: int, max_model_len: int, block_size: int, num_kv_blocks: int) -> tuple[int, ...]:
    """Refuse a request an engine with these limits cannot run, naming the field; returns the prior outputs as
    a tuple of ints."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"request {request_id!r}: params must be SamplingParams, got {type(params).__name__}")
    if not prompt:
        raise ValueError(f"request {request_id!r}: the prompt is empty")
    check_token_ids(request_id, "token ids", prompt, vocab_size)
    for what, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias]),
                      ("bad_words_token_ids", [t for w in params.bad_words_token_ids for t in w])):
        check_token_ids(request_id, f"SamplingParams.{what}", ids, vocab_size)
    if len(prompt) >= max_model_len:
        raise ValueError(f"request {request_id!r}: prompt of {len(prompt)} tokens leaves no room to generate "
                         f"within max_model_len {max_model_len}")
    prior = tuple(operator.index(t) for t in prior_output_ids)
    check_token_ids(request_id, "prior_output_ids", prior, vocab_size)
    if len(prior) >= params.max_tokens:
        raise ValueError(f"request {request_id!r}: prior_output_ids holds {len(prior)} tokens, leaving none of "
                         f"SamplingParams.max_tokens {params.max_tokens} to generate")
    if len(prompt) + len(prior) >= max_model_len:
        raise ValueError(f"request {request_id!r}: prompt of {len(prompt)} tokens and prior_output_ids of "
                         f"{len(prior)} leave no room to generate within max_model_len {max_model_len}")
    longest = min(len(prompt) + params.max_tokens, max_model_len)
    if -(-longest // block_size) > num_kv_blocks:
        raise ValueError(f"request {request_id!r}: {longest} tokens need more than the "
                         f"{num_kv_blocks} KV blocks of this engine")
    return prior


def check_token_ids(request_id: str, what: str, token_ids: Sequence[int], vocab_size: int) -> None:
    if not token_ids or (0 <= min(token_ids) and max(token_ids) < vocab_size):  # a long prompt's common case
        return
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"request {request_id!r}: {what} {bad[:5]} are outside the vocabulary [0, {vocab_size})")
