"""ServingBackend: the contract between the HTTP coordinator and whatever runs the model.

The coordinator owns HTTP, tokenization, detokenization, stop strings and metrics of the request as the client
sees it; the backend owns workers, routing, KV transfer and every block. Implementations: the Ray prefill/decode
pools (`coordinator.backend.ray_backend`, disaggregated or collocated) and, in tests, an in-process engine.
Everything here is torch-free.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from coordinator.observability.phases import PhaseTrace
from engine.core.request import PromptLogprob, TokenLogprob
from engine.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # stop_token_ids already merged in; stop strings stay with the coordinator
    priority: int = 2       # admission order, lower first: 0 migrations, 1-3 tenants' high/normal/low (tenants.py)
    n: int = 1              # choices of this prompt (engine.choices), prefilled once: ServingBackend.generate_group
    # the reader takes tokens this many at a time after the first (ServerSettings.stream_interval): a backend may
    # hold outputs back until a chunk's worth is in, to wake the reader less often (coordinator.backend.held_queue)
    stream_interval: int = 1
    trace: PhaseTrace | None = field(default=None, compare=False, repr=False)  # its phases (generate() marks them)
    # a consumer's direct line for a running stream's plain token ids (the core process: the link to the request's
    # HTTP process): a backend may hand it tokens in the middle of a stream (no logprobs, not the first delta, not
    # the last) instead of yielding them from generate(), skipping the per-delta generator chain; None: every delta
    # is yielded
    sink: Callable[[list[int]], None] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request. The last delta of a stream has finish_reason set ("stop" | "length")."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[PromptLogprob] | None = None  # on the first delta, when params.prompt_logprobs is set
    # on the first delta of an attempt whose worker computed its prompt: the prompt (and prior output) tokens whose
    # KV was not computed for it (device prefix hits, host-tier restores): usage.prompt_tokens_details.cached_tokens
    cached_tokens: int | None = None


class BackendError(Exception):
    """The backend could not serve the request (a worker died, a transfer failed...): a 5xx, or an in-band error."""


class RequestTooLarge(BackendError):
    """The request can never fit (its KV exceeds every worker's whole cache): a 400, never retried."""


class WorkerLost(BackendError):
    """The worker running the request died or lost its KV: the backend moves the request elsewhere, and only a
    request that ran out of moves reaches the client as an error."""


class PrefillFailed(BackendError):
    """The prefill worker's prefill call failed (an error there, not its death, which moves the request anyway): the
    backend runs the request whole on a decode worker once (recovery.prefill_retry), else the client gets it."""


class TransferFailed(BackendError):
    """The decode worker could not pull the request's KV (it freed what it had reserved)."""


class Overloaded(BackendError):
    """No capacity now and the admission queue is full: 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(Overloaded):
    """No worker can serve the request until an operator acts (every slot of a pool it needs gave up its restarts):
    503 with Retry-After at once, naming why, instead of a wait in admission that could only end in a timeout."""


class GroupStream(Protocol):
    def __aiter__(self) -> AsyncIterator[tuple[int, TokenDelta]]: ...

    def __anext__(self) -> Awaitable[tuple[int, TokenDelta]]: ...

    def stop(self, index: int) -> None:
        """Choice `index` is over for the client (a stop string): abort it on its worker, drop its deltas."""

    async def aclose(self) -> None: ...


class ServingBackend(Protocol):
    model_name: str        # the id served at /v1/models
    model_path: str        # checkpoint folder (the coordinator loads the tokenizer from it)
    max_model_len: int
    vocab_size: int

    async def start(self) -> None:
        """Create the workers and wait until every one has loaded its model."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Stream the request's tokens. Raises Overloaded (before the first delta) or BackendError.
        Marks the phases it owns on `request.trace` (coordinator.observability.phases), if it has one and records
        phases.
        Closing the iterator early (aclose, or the consumer being cancelled) aborts the request everywhere and
        frees its blocks; the backend guarantees the stream ends, with a delta or an error, in bounded time."""

    def generate_group(self, request: GenerateRequest) -> GroupStream:
        """request.n choices of one prompt (or one with prompt logprobs), prefilled once: (choice index, delta)
        pairs until every choice ended; same closing contract as generate()."""

    def health(self) -> tuple[bool, list[dict]]:
        """(every pool has a live worker, one entry per worker: name, role, state, restarts)."""

    def stats(self) -> dict:
        """Load and transfer figures for /metrics: {"workers": [{"name", "role", "queued_prompt_tokens",
        "running", "free_blocks", "total_blocks"}, ...], "transfer": {...}, "queue_length": int}."""

    async def shutdown(self) -> None:
        """Stop the workers; in-flight streams end with BackendError."""
