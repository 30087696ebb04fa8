"""The request life cycle in the coordinator: one request's bounded backend stream (the in-flight count and drain:
coordinator.api.drain).

Owns:
- `Generation`: one admitted request (one sequence: a choice of an n > 1 request is one) from the first backend
  call to its end. Every `next_piece()` is bounded by
  the request's deadline (one timer per request, armed at the first wait, which cancels a wait still under way at
  the deadline: not a cancel scope and a timer per delta, a quarter of the coordinator's CPU per token);
  `close()` always closes the backend iterator (which aborts the request on the workers and frees its blocks
  unless it already finished), shielded from cancellation, and records the outcome. With a PhaseTrace
  (coordinator.observability.phases) it marks `ingress` when the backend stream opens, and `close()` observes the
  final phases,
  closed at the same instant as the end-to-end latency, so their sum equals it, and (tracing on) exports the
  request's spans (coordinator.observability.tracing). It reports the sequence's end
  (outcome, finish reason as the client got it, tokens, first and last token times, phases) to
  coordinator.observability.request_metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from coordinator import errors
from coordinator.admission.tenants import Grant
from coordinator.api.reasoning import ReasoningSplit
from coordinator.api.text_output import TextOutput, TokenInfo
from coordinator.contract import (
    BackendError,
    GenerateRequest,
    Overloaded,
    RequestTooLarge,
    ServingBackend,
    TokenDelta,
    Unavailable,
)
from coordinator.observability.metrics import Metrics
from coordinator.observability.phases import PhaseTrace
from coordinator.observability.request_metrics import Parent, SequenceEnd
from coordinator.observability.tracing import RequestSpan

CLOSE_TIMEOUT_S = 10.0  # the backend promises a bounded close; never wait on it forever


@dataclass
class Piece:
    """What one backend delta adds to the client's view: text (may be ""), logprob entries, maybe the end, and the
    ids of the tokens it consumed (up to the one that completed a stop string: as many as it counts in usage)."""

    text: str
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    reasoning: str = ""  # with a reasoning parser (coordinator.api.reasoning): the reasoning text; `text` is content


class Generation:
    """One request against the backend: deltas in, Pieces out, always closed, outcome and timings recorded."""

    def __init__(self, backend: ServingBackend, request: GenerateRequest, text: TextOutput, metrics: Metrics,
                 timeout_s: float, want_logprobs: bool, arrival: float, grant: Grant | None = None,
                 counts_request: bool = True, trace: PhaseTrace | None = None, parent: Parent | None = None,
                 span: RequestSpan | None = None, reasoning: ReasoningSplit | None = None) -> None:
        self._backend = backend
        self.request = request
        self.text = text
        self._metrics = metrics
        self._timeout_s = timeout_s
        self.deadline = arrival + timeout_s  # time.monotonic()
        self._want_logprobs = want_logprobs
        self._arrival = arrival
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None
        self._stream = None
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None  # fires at the deadline
        self._waiter: asyncio.Task | None = None        # the task waiting for the next delta, if one is
        self._expired = False
        self._pending_error: errors.APIError | None = None  # met while gathering a piece: raised after it
        self._cancelled_waiter = False                  # the timer cancelled the waiter
        self._grant = grant  # the tenant's charge, settled in close()
        # False for choices 1.. of an n>1 request: one request, one prompt and one TTFT/e2e sample per prompt
        self._counts_request = counts_request
        self.trace = trace  # the request's phases (the one given to the backend in request.trace), if traced
        self._parent = parent  # the choices of its prompt, when it is one of several
        self._span = span      # its OpenTelemetry trace, when tracing is on (with a PhaseTrace)
        self.finish_reason: str | None = None
        self.client_finish: str | None = None  # the finish reason the client got, where the API changed it (tool_calls)
        self.reasoning = reasoning  # splits the text into reasoning and content (chat with a reasoning parser)
        self._reasoning_parts: list[str] = []  # the reasoning of the piece being gathered
        self._cached_tokens: int | None = None  # the first attempt's that reported it (TokenDelta.cached_tokens)

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return self.text.num_tokens

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV the worker that computed the prompt did not compute (usage's
        prompt_tokens_details.cached_tokens): as reported with the first delta that carried it, at most the
        prompt (a resumed attempt also counts its prior outputs); 0 until then."""
        return min(self._cached_tokens or 0, self.prompt_tokens)

    async def next_piece(self) -> Piece:
        """The next piece of output: one backend delta's tokens, or with the request's stream_interval n > 1 (after
        the first token) those of as many deltas as make n tokens or reach the end. Raises APIError (503 overloaded, 502
        backend failure, 504 timeout); one that comes while a piece is being gathered is raised by the next call,
        after that piece is returned (the client gets every token it was charged for)."""
        if self.finish_reason is not None:
            raise RuntimeError("Generation.next_piece after the end")
        if self._pending_error is not None:
            error, self._pending_error = self._pending_error, None
            raise error
        first = self._last_token_at is None
        parts: list[str] = []
        infos: list[TokenInfo] = []
        ids: list[int] = []
        count = 0
        while True:
            try:
                delta = await self._next_delta()
            except errors.APIError as e:
                if not count:
                    raise
                self._pending_error = e
                return Piece("".join(parts), infos, None, ids, self._take_reasoning())
            finish = self._take(delta, parts, infos, ids)
            count += len(delta.token_ids)
            if finish is not None or first or count >= self.request.stream_interval:
                break
        self.finish_reason = finish
        return Piece("".join(parts), infos, finish, ids, self._take_reasoning())

    def _take_reasoning(self) -> str:
        text, self._reasoning_parts = "".join(self._reasoning_parts), []
        return text

    def _split(self, text: str, token: bool) -> str:
        """The content of newly released text (its reasoning set aside for the piece), or the text itself."""
        if self.reasoning is None:
            return text
        reasoning, content = self.reasoning.take_token(text) if token else self.reasoning.feed(text)
        self._reasoning_parts.append(reasoning)
        return content

    def _take(self, delta: TokenDelta, parts: list[str], infos: list[TokenInfo], ids: list[int]) -> str | None:
        """Add a delta's tokens to the output (text into `parts`, logprob entries into `infos`, the ids consumed
        into `ids`); its finish."""
        now = time.monotonic()
        if self._cached_tokens is None and delta.cached_tokens is not None:
            self._cached_tokens = delta.cached_tokens
        consumed = 0
        for i, token_id in enumerate(delta.token_ids):
            text = self.text.add_token(token_id)
            parts.append(text if self.reasoning is None else self._split(text, True))
            ids.append(token_id)
            consumed += 1
            if self._want_logprobs and i < len(delta.logprobs):
                infos.append(self.text.token_info(delta.logprobs[i]))
            if self.text.stopped:
                break
        if consumed:
            first = self._last_token_at is None
            if first:
                self._first_token_at = now
                if self._counts_request:
                    self._metrics.ttft.observe(now - self._arrival)
            # per token, as vLLM counts them (one sample per token after the first): the k tokens of one delivery
            # share its gap; those that came with the first token came with no gap
            share = 0.0 if first else (now - self._last_token_at) / len(delta.token_ids)
            for _ in range(consumed - first):
                self._metrics.itl.observe(share)
            self._last_token_at = now
        finish = "stop" if self.text.stopped else delta.finish_reason
        if finish is not None and not self.text.stopped:
            parts.append(self._split(self.text.finish(), False))
        if finish is not None and self.reasoning is not None:
            reasoning, content = self.reasoning.finish()
            self._reasoning_parts.append(reasoning)
            parts.append(content)
        return finish

    async def collect(self) -> list[Piece]:
        pieces = [await self.next_piece()]
        while pieces[-1].finish_reason is None:
            pieces.append(await self.next_piece())
        return pieces

    async def _next_delta(self) -> TokenDelta:
        try:
            if self._expired or time.monotonic() >= self.deadline:
                raise TimeoutError
            if self._stream is None:
                if self.trace is not None:
                    self.trace.mark("ingress")
                self._stream = self._backend.generate(self.request)
            return await self._until_deadline(self._stream)
        except TimeoutError:
            raise errors.timeout(self._timeout_s) from None
        except Unavailable as e:
            raise errors.unavailable(f"No worker can serve this request until an operator acts: {e}",
                                     e.retry_after_s, "unavailable") from None
        except Overloaded as e:
            raise errors.unavailable(f"The server is overloaded: {e}", e.retry_after_s, "overloaded") from None
        except RequestTooLarge as e:
            raise errors.invalid_request(f"The request can never fit this server: {e}", "max_tokens",
                                         "context_length_exceeded") from None
        except BackendError as e:
            raise errors.backend_failure(str(e) or "the worker gave no reason") from None
        except StopAsyncIteration:
            raise errors.backend_failure("the token stream ended without a finish reason") from None

    async def _until_deadline(self, stream: AsyncIterator[TokenDelta]) -> TokenDelta:
        """The stream's next delta, or TimeoutError if the deadline passes first (as asyncio.timeout decides it:
        only a cancellation of ours, with no other one pending, becomes the TimeoutError)."""
        loop = asyncio.get_running_loop()
        if self._timer is None:
            self._timer = loop.call_at(loop.time() + self.deadline - time.monotonic(), self._expire)
        task = asyncio.current_task()
        cancelling = task.cancelling()
        self._waiter = task
        try:
            return await stream.__anext__()
        except asyncio.CancelledError:
            if self._cancelled_waiter:
                self._cancelled_waiter = False
                if task.uncancel() <= cancelling:
                    raise TimeoutError from None
            raise
        finally:
            self._waiter = None
            if self._cancelled_waiter:  # the stream swallowed our cancellation: undo its count
                self._cancelled_waiter = False
                task.uncancel()

    def _expire(self) -> None:
        self._expired = True
        if self._waiter is not None:
            self._cancelled_waiter = True
            self._waiter.cancel()

    async def close(self, outcome: str) -> None:
        """End the request: close the backend stream (an abort unless it finished) and record `outcome`
        (finished, aborted, failed, timeout). Safe to call from a cancelled task, and more than once."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if outcome == "aborted" and time.monotonic() >= self.deadline:
            outcome = "timeout"  # cut by the response's deadline (a client that stopped reading)
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + CLOSE_TIMEOUT_S
            aclose = getattr(self._stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001 - the stream is gone either way; the outcome is what matters
                    outcome = "failed" if outcome == "finished" else outcome
        if self._grant is not None:  # the tenant is charged prompt + the tokens it really got
            self._grant.settle(self.completion_tokens, outcome, prompt_processed=self._last_token_at is not None)
        phases = None
        if self._counts_request:
            now = time.monotonic()
            self._metrics.requests.inc(outcome)
            self._metrics.prompt_tokens.inc(self.prompt_tokens)
            self._metrics.e2e.observe(now - self._arrival)
            if self.trace is not None:
                phases = self.trace.finish(now)
                for phase, seconds in phases.items():
                    self._metrics.phases.labels(phase).observe(seconds)
                if self._span is not None:
                    self._span.end(self.trace, self.request.request_id, outcome, self.prompt_tokens,
                                   self.completion_tokens, self.request.params.max_tokens,
                                   self.client_finish or self.finish_reason)
        self._metrics.generation_tokens.inc(self.completion_tokens)
        self._metrics.sequences.observe(SequenceEnd(
            outcome, self.client_finish or self.finish_reason, self.prompt_tokens, self.completion_tokens,
            self.request.params.max_tokens, self._first_token_at, self._last_token_at, self._counts_request, phases),
            self._parent)
