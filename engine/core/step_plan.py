"""The plain dataclasses between the scheduler and the model runner: a step's plan (SchedulerOutput: the requests'
chunks, the KV copies to and from the host to run before it) and what it did to each request (StepOutput). The
Scheduler (engine.core.scheduler) makes the first and applies the second; the runner reads the first; nothing here
holds state or behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import PromptLogprob, TokenLogprob

PENDING_TOKEN = -1  # token id of a chunk whose input is still being sampled on the device


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's work in one step: compute KV for `token_ids` at positions start_pos.. and maybe sample."""

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    output_index: int  # index of the token to sample among the request's outputs (for seeded sampling)
    incarnation: int = 0  # its request's Request.incarnation when planned


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (block, host slot): copy before the step
    swap_in: list[tuple[int, int]] = field(default_factory=list)   # (host slot, block): copy before the step
    tier_out: list[tuple[int, int]] = field(default_factory=list)  # (evicted block, host-tier slot): copy first
    tier_in: list[tuple[int, int]] = field(default_factory=list)   # (host-tier slot, block): copy before the step
    restored: list[str] = field(default_factory=list)  # requests whose tier_in copies these are

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True)
class StepOutput:
    """What one step did to one request: the tokens it gained and, if it ended, why."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finish_reason: str | None
    pinned_block_ids: list[int] | None = None  # set once a prefill-only request is done and pinned
    fork_first: list[tuple[int, TokenLogprob | None]] | None = None  # a group prefill's choices 1..n-1 first tokens
    prompt_logprobs: list[PromptLogprob] | None = None  # with the first token, when params.prompt_logprobs is set
    prefill_only: bool = False  # the request was added prefill_only (its output is a prefill's result, no stream's)
    # with the first token sampled here for a request computed here: its prompt (and prior output) tokens whose KV
    # was not computed for it (prefix-cache hits, host-tier restores); None on every other output
    num_cached_tokens: int | None = None
