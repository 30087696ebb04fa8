"""Choices: requests with several outputs (n, best_of, a list of prompts) or echo / prompt_logprobs, fanned out to the
backend and aggregated into one OpenAI (or vLLM) response, whole or streamed.

Each prompt is one backend group (ServingBackend.generate_group: prefilled once, n choices forked from it); `Fanout`
splits a group's (choice, delta) pairs into one stream per choice, so every choice runs through its own
lifecycle.Generation (its own TextOutput: stop strings, detokenization, logprobs, deadline). A choice that ends on a
stop string closes its stream, which aborts that choice only (GroupStream.stop); the group ends when every choice
has, or on the first error; a client disconnect closes every choice. Indices follow OpenAI: prompt i, choice j -> i *
n + j. Chat `echo` (vLLM's) puts the last message's content before each choice's when its role is the generated one's
(protocol.chat_echo). Usage: each prompt counted once, completion tokens summed over every choice generated (best_of:
all best_of sequences, which OpenAI bills too). best_of (never streamed) keeps the n choices of highest cumulative
logprob, in that order. echo puts the prompt's text (and with logprobs its tokens, the first one's logprob null)
before each choice's own; prompt_logprobs (vLLM) returns, per choice (chat: once, top level), a null then {token id:
{logprob, rank, decoded_token}} per prompt token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator.api import engine_inputs, protocol, reasoning
from coordinator.api.lifecycle import Generation, Piece
from coordinator.api.sse import Formatter
from coordinator.api.text_output import TextOutput
from coordinator.contract import GenerateRequest, GroupStream, TokenDelta
from coordinator.observability.request_metrics import Parent
from engine.core.request import PromptLogprob


def wanted(req: Any) -> bool:
    """Whether the request needs this path (the single-choice path serves everything else, with migration)."""
    return ((req.n or 1) > 1 or req.prompt_logprobs is not None or (getattr(req, "best_of", None) or 1) > 1
            or getattr(req, "echo", False) or len(getattr(req, "prompts", [None])) > 1)


class Fanout:
    """One group's choices as separate backends for Generation: choice j's generate() yields its deltas."""

    def __init__(self, group: GroupStream, n: int) -> None:
        self._group = group
        self._queues: list[asyncio.Queue] = [asyncio.Queue() for _ in range(n)]
        self._open = n
        self.prompt_logprobs: list[PromptLogprob] | None = None
        self._pump: asyncio.Future | None = None  # started by the first read: nothing runs before admission

    async def _run(self) -> None:
        try:
            async for j, delta in self._group:
                if delta.prompt_logprobs is not None:
                    self.prompt_logprobs = delta.prompt_logprobs
                self._queues[j].put_nowait(delta)
        except BaseException as e:  # noqa: BLE001 - every choice's stream ends with it
            for q in self._queues:
                q.put_nowait(e)

    def choice(self, j: int) -> _ChoiceBackend:
        return _ChoiceBackend(self, j)

    async def _next(self, j: int) -> TokenDelta:
        if self._pump is None:
            self._pump = asyncio.ensure_future(self._run())
        item = await self._queues[j].get()
        if isinstance(item, BaseException):
            self._queues[j].put_nowait(item)
            raise item
        return item

    async def _close(self, j: int, finished: bool) -> None:
        self._open -= 1
        if not finished:
            self._group.stop(j)
        if self._open == 0 and self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
            await self._group.aclose()


@dataclass
class _ChoiceBackend:
    fanout: Fanout
    index: int
    finished: bool = False

    def generate(self, request: GenerateRequest) -> _ChoiceBackend:
        return self

    def __aiter__(self) -> _ChoiceBackend:
        return self

    async def __anext__(self) -> TokenDelta:
        delta = await self.fanout._next(self.index)
        self.finished = delta.finish_reason is not None
        return delta

    async def aclose(self) -> None:
        await self.fanout._close(self.index, self.finished)


@dataclass
class Choice:
    index: int
    gen: Generation
    fanout: Fanout
    prompt_text: str
    prompt_ids: list[int]
    pieces: list[Piece] = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob for p in self.pieces for t in p.tokens)


def build(app: Any, req: Any, chat: bool, request_id: str, priority: int, arrival: float,
          stream_interval: int = 1) -> list[Choice]:
    """Every choice of the request (each group starts with its first read: admit before reading); each streams
    `stream_interval` tokens per chunk after its first."""
    backend, settings, tok = app.state.backend, app.state.settings, app.state.tokenizer
    prompts = [None] if chat else req.prompts
    n, fan = req.n or 1, (getattr(req, "best_of", None) or req.n or 1)
    num_logprobs = req.num_logprobs if chat else req.logprobs
    echo = not chat and req.echo
    echoed = protocol.chat_echo(req) if chat else ""  # vLLM's chat echo: the last message's content, or ""
    parser = settings.reasoning_parser if chat else None
    out: list[Choice] = []
    for i, prompt in enumerate(prompts):
        one = req if chat else req.model_copy(update={"prompt": prompt})
        ids = engine_inputs.prompt_token_ids(one, tok, backend.vocab_size, settings.allow_special_tokens_in_content)
        max_tokens = engine_inputs.max_tokens(one, len(ids), backend.max_model_len)
        params = engine_inputs.sampling_params(one, max_tokens, num_logprobs, tok, backend.vocab_size)
        ranked = fan > n and params.logprobs is None  # best_of ranks by logprobs: ask for the chosen token's
        prompt_lp = req.prompt_logprobs if req.prompt_logprobs is not None else (
            num_logprobs if echo and num_logprobs is not None else None)
        params = replace(params, prompt_logprobs=prompt_lp, logprobs=0 if ranked else params.logprobs)
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        group = backend.generate_group(GenerateRequest(rid, ids, params, priority, n=fan))
        fanout = Fanout(group, fan)
        parent = Parent(n, fan)  # vLLM's parent request: n and its choices' longest output, once all have ended
        text = prompt if isinstance(prompt, str) else tok.decode(ids)
        for j in range(fan):
            output = TextOutput(tok, ids, req.stop_strings, req.include_stop_str_in_output, req.skip_special_tokens,
                                req.min_tokens, bool(req.return_tokens_as_token_ids))
            choice = GenerateRequest(f"{rid}#{j}", ids, params, priority, stream_interval=stream_interval)
            gen = Generation(fanout.choice(j), choice, output, app.state.metrics, settings.request_timeout_s,
                             params.logprobs is not None, arrival, counts_request=j == 0, parent=parent,
                             reasoning=reasoning.for_request(parser, req))
            out.append(Choice(i * fan + j, gen, fanout, text if echo else echoed, ids))
    return out


def usage(choices: list[Choice], reasoning: bool = False) -> tuple[int, ...]:
    """(prompt tokens, each prompt once; completion tokens of every choice), and with `reasoning` (a reasoning
    parser) their reasoning tokens."""
    prompts = {c.index // len([d for d in choices if d.fanout is c.fanout]): len(c.prompt_ids) for c in choices}
    counts = sum(prompts.values()), sum(c.gen.completion_tokens for c in choices)
    if not reasoning:
        return counts
    return *counts, sum(c.gen.reasoning.tokens for c in choices if c.gen.reasoning is not None)


def cached_tokens(choices: list[Choice]) -> int:
    """usage's prompt_tokens_details.cached_tokens: per prompt (counted once, as in usage), the most any of its
    choices was told (they share one prefill)."""
    per_prompt: dict[int, int] = {}
    for c in choices:
        per_prompt[id(c.fanout)] = max(per_prompt.get(id(c.fanout), 0), c.gen.cached_tokens)
    return sum(per_prompt.values())


def best(choices: list[Choice], n: int, fan: int) -> list[Choice]:
    """best_of: per prompt, the n choices of highest cumulative logprob, reindexed i * n + j."""
    if fan == n:
        return choices
    kept = []
    for i in range(len(choices) // fan):
        top = sorted(choices[i * fan:(i + 1) * fan], key=lambda c: -c.cumulative_logprob)[:n]
        kept += [replace(c, index=i * n + j) for j, c in enumerate(top)]
    return kept


def logprobs_body(fmt: Formatter, c: Choice, piece: Piece, first: bool, echo_lp: bool) -> dict:
    """The choice's logprobs for this piece; with echo, the first piece starts with the prompt's tokens, each prompt
    token's top_logprobs holding the token itself besides its alternatives, as a generated token's do (vLLM's:
    `logprobs: 0` gives {token: logprob}, k gives k or k + 1 entries)."""
    body = fmt.logprobs(piece.tokens)
    if not (first and echo_lp) or fmt.chat:
        if c.prompt_text and not fmt.chat:
            body["text_offset"] = [o + len(c.prompt_text) for o in body["text_offset"]]
        return body
    text, name = c.gen.text.token_text, c.gen.text.token_name  # name: `token_id:<id>` with return_tokens_as_token_ids
    entries = c.fanout.prompt_logprobs or []
    words = [text(t)[0] for t in c.prompt_ids]
    offsets = [sum(len(w) for w in words[:k]) for k in range(len(words))]
    return {"tokens": [name(t) for t in c.prompt_ids] + body["tokens"],
            "token_logprobs": [None] + [e.logprob for e in entries] + body["token_logprobs"],
            "top_logprobs": [None] + [{**{name(t): v for t, v in e.top_logprobs.items()}, name(e.token_id): e.logprob}
                                      for e in entries] + body["top_logprobs"],
            "text_offset": offsets + [o + len(c.prompt_text) for o in body["text_offset"]]}
