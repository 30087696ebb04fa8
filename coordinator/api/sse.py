"""Server-sent events and the OpenAI response shapes (completions and chat, whole and streamed).

Owns: `SSEResponse`, a streaming response that cancels the event producer (whose cleanup closes the backend
stream: an abort) when the client goes away, whatever the server's ASGI spec version, when a write has been blocked
on a client that stopped reading for `server.stall_timeout_s` (coordinator.api.stall_watch), or when its deadline
passes; `event()`
and `DONE` framing (`data: {json}\\n\\n`, `data: [DONE]\\n\\n`); and `Formatter`, which builds every JSON body
of one request: chunks (chat's first has delta.role = "assistant"), the usage chunk (with `phases`, seconds per
phase of coordinator.observability.phases, when the request asked for them), and non-streamed responses, all with the
body id derived from the request id; with vLLM's fields where vLLM puts them: `prompt_logprobs` (null unless asked
for) on a whole chat response and on each whole completion choice, and with `return_token_ids` the choices'
`token_ids` and the prompt's `prompt_token_ids` (`add_token_ids`; null on a whole response without it).

Per-chunk costs, paid once per token by a busy coordinator, are kept small: the middle chunks of a stream go to
the ASGI server's own `send` (scope[SERVER_SEND], put there by `DirectStreamAPI`), past the middleware layers, which
only act on a response's start and end (those still go through them; a middleware that rewrites response bodies,
such as compression, would have to see every chunk and must not be added); and a chunk of plain text is the
request's fixed bytes around the JSON-encoded text (`Formatter.text_event`), the same bytes as `event(chunk(...))`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import anyio
from fastapi import FastAPI
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from coordinator.api.lifecycle import Piece
from coordinator.api.reasoning import fields as reasoning_fields
from coordinator.api.stall_watch import StallPolicy, StallWatch
from coordinator.api.text_output import TokenInfo, floored
from coordinator.observability.phases import wire

DONE = b"data: [DONE]\n\n"
SERVER_SEND = "pdserve.server_send"  # scope key: the ASGI server's send, under every middleware's wrapper
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # one encoder, not one per event
_TEXT_MARK = "\ufdd0pdserve-text\ufdd0"  # where a text chunk's text goes; noncharacters, unlike any real text


def event(obj: dict) -> bytes:
    return b"data: " + _encode(obj).encode() + b"\n\n"


class DirectStreamAPI(FastAPI):
    """FastAPI that also hands its routes the ASGI server's own `send` (scope[SERVER_SEND]), for SSEResponse."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], deadline: float | None = None,
                 headers: dict[str, str] | None = None, stall: StallPolicy | None = None) -> None:
        self.events = events
        self.deadline = deadline  # time.monotonic() after which the stream is cut, even if blocked on a slow reader
        self.stall = stall        # cut the stream once a write has been blocked this long (None: only the deadline)
        self.stall_watch: StallWatch | None = None
        self.writes = 0           # odd while a write is under way (what the stall watch reads)
        self.status_code = 200
        self.background = None
        self.disconnected = False
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg, aclosing(self.events) as events:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.disconnected = True
                tg.cancel_scope.cancel()

            if self.deadline is not None:
                tg.cancel_scope.deadline = anyio.current_time() + self.deadline - time.monotonic()
            tg.start_soon(watch)
            if self.stall is not None:
                self.stall_watch = StallWatch(self.stall, lambda: self.writes, scope, tg.cancel_scope)
                tg.start_soon(self.stall_watch.run)
            send_chunk = scope.get(SERVER_SEND, send)
            self.writes += 1
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self.writes += 1
            async for chunk in events:
                self.writes += 1
                await send_chunk({"type": "http.response.body", "body": chunk, "more_body": True})
                self.writes += 1
            self.writes += 1
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.writes += 1
            tg.cancel_scope.cancel()


class Formatter:
    """The JSON bodies of one request; `chat` picks chat.completion(.chunk) over text_completion.
    The body `id` is the request id (X-Request-Id) with OpenAI's prefix (`chatcmpl-` / `cmpl-`) added unless it
    already starts with it: a generated request id is the body id itself, a client's `abc` becomes `cmpl-abc`."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False, request_id: str | None = None,
                 include_phases: bool = False, return_token_ids: bool = False,
                 prompt_token_ids: list[int] | None = None, reasoning: bool = False) -> None:
        self.chat = chat
        # a reasoning parser reads this request (coordinator.api.reasoning): messages carry `reasoning` (null when
        # the output had none), deltas carry it when they have some, usage counts reasoning_tokens
        self.reasoning = reasoning
        self.return_token_ids = return_token_ids  # vLLM's: token_ids on choices, prompt_token_ids (add_token_ids)
        self.prompt_token_ids = prompt_token_ids  # the single-choice path's prompt
        self.model = model
        self.include_usage = include_usage
        self.include_phases = include_phases  # pdserve's stream_options.include_phases (needs include_usage)
        # stream_options.continuous_usage_stats: every chunk's usage, (prompt, completion, cached prompt tokens) so
        # far; None: null
        self.usage_so_far: Callable[[], tuple[int, int, int]] | None = None
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = request_id if request_id is not None else uuid.uuid4().hex
        self.id = rid if rid.startswith(prefix) else prefix + rid
        self.created = int(time.time())
        self._text_template: tuple[bytes, bytes] | None = None

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
              cached_tokens: int = 0) -> dict:
        """OpenAI's usage object; `cached_tokens`: prompt tokens whose KV was not computed for the request (prefix
        hits on the device or restored from the host tier), always reported, as OpenAI does."""
        body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        if reasoning_tokens is not None:  # vLLM's (and OpenAI's) place for it, with a reasoning parser only
            body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return body

    def chunk(self, piece: Piece, logprobs: bool, first: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": piece.text} if first else (
                {"content": piece.text} if piece.text else {})
            if piece.reasoning:
                delta.update(reasoning_fields(piece.reasoning))
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": piece.text}
        choice["logprobs"] = self.logprobs(piece.tokens) if logprobs else None
        choice["finish_reason"] = piece.finish_reason
        body = {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            if self.usage_so_far is None:
                body["usage"] = None
            else:
                prompt, completion, cached = self.usage_so_far()
                body["usage"] = self.usage(prompt, completion, cached_tokens=cached)
        self.add_token_ids(body, choice, piece.token_ids, self.prompt_token_ids if first else None)
        return body

    def add_token_ids(self, body: dict, choice: dict, token_ids: list[int], prompt_ids: list[int] | None,
                      whole: bool = False) -> None:
        """With return_token_ids (vLLM's), the choice's `token_ids` and, when given (a whole response, a choice's
        first chunk), `prompt_token_ids` on a chat body or a completion choice, where vLLM puts them. Without it a
        `whole` response still has both keys, null, as vLLM's has (clients read them as fields, not maybe-keys)."""
        prompt_at = body if self.chat else choice
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if prompt_ids is not None:
                prompt_at["prompt_token_ids"] = list(prompt_ids)
        elif whole:
            choice["token_ids"] = None
            prompt_at["prompt_token_ids"] = None

    def chunk_event(self, piece: Piece, logprobs: bool, first: bool = False) -> bytes:
        """`event(self.chunk(piece, logprobs, first))`; a plain text chunk (most of a stream) from its template."""
        if (logprobs or first or not piece.text or piece.finish_reason is not None or self.usage_so_far is not None
                or self.return_token_ids or piece.reasoning):
            return event(self.chunk(piece, logprobs, first))
        return self.text_event(piece.text)

    def text_event(self, text: str) -> bytes:
        """`event(self.chunk(Piece(text), False))` for a chunk of text without logprobs or finish reason (for chat,
        neither the first chunk nor an empty one): the text encoded between the request's fixed bytes."""
        if self._text_template is None:
            whole, mark = event(self.chunk(Piece(_TEXT_MARK), False)), _encode(_TEXT_MARK).encode()
            head, _, tail = whole.rpartition(mark)  # the text comes after the id and the model name
            self._text_template = (head, tail)
        head, tail = self._text_template
        return head + _encode(text).encode() + tail

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, phases: dict[str, float] | None = None,
                    reasoning_tokens: int | None = None, cached_tokens: int = 0) -> dict:
        body = {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage(prompt_tokens, completion_tokens, reasoning_tokens, cached_tokens)}
        if phases is not None:
            body["phases"] = wire(phases)
        return body

    def response(self, text: str, tokens: list[TokenInfo], logprobs: bool, finish_reason: str,
                 prompt_tokens: int, completion_tokens: int, token_ids: list[int] = (),
                 reasoning: str | None = None, reasoning_tokens: int | None = None, cached_tokens: int = 0) -> dict:
        lp = self.logprobs(tokens) if logprobs else None
        if self.chat:  # vLLM's prompt_logprobs, null unless asked for (coordinator.api.choices serves those)
            choice = {"index": 0, "message": self.message(text, reasoning), "logprobs": lp,
                      "finish_reason": finish_reason}
            extra = {"prompt_logprobs": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason, "prompt_logprobs": None}
            extra = {}
        body = {**self._base("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": self.usage(prompt_tokens, completion_tokens, reasoning_tokens, cached_tokens), **extra}
        self.add_token_ids(body, choice, token_ids, self.prompt_token_ids, whole=True)
        return body

    def choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None, stream: bool,
               first: bool = False, reasoning: str | None = None) -> dict:
        """One entry of `choices` (coordinator.api.choices: several per body, each with its own index)."""
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if stream:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            if reasoning:
                delta.update(reasoning_fields(reasoning))
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "message": self.message(text, reasoning), "logprobs": logprobs,
                "finish_reason": finish_reason}

    def message(self, content: str, reasoning: str | None) -> dict:
        """A whole chat message; with a reasoning parser, its reasoning (null when the output had none) and a
        content that is null when nothing followed the reasoning (vLLM's)."""
        if not self.reasoning:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or (None if reasoning is not None else content),
                **reasoning_fields(reasoning)}

    def body(self, choices: list[dict], stream: bool, usage: tuple[int, ...] | None = None, cached_tokens: int = 0,
             **extra: Any) -> dict:
        """A whole response (stream false) or one chunk holding `choices`; `extra`: vLLM's top-level fields."""
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        body = {**self._base(kind), "choices": choices, **extra}
        if not stream:
            body["usage"] = self.usage(*usage, cached_tokens=cached_tokens)
        elif self.include_usage:
            body["usage"] = None
        return body

    @staticmethod
    def prompt_logprobs(entries: list, token_text: Callable[[int], str]) -> list[dict | None]:
        """vLLM's prompt_logprobs: null for the first prompt token, then {token id: {logprob, rank,
        decoded_token}} holding the prompt token and its top alternatives (rank: 1 = most likely)."""
        out: list[dict | None] = [None]
        for e in entries:
            ranks = {t: r for r, t in enumerate(sorted(e.top_logprobs, key=lambda t: -e.top_logprobs[t]), 1)}
            row = {str(t): {"logprob": floored(v), "rank": ranks[t], "decoded_token": token_text(t)}
                   for t, v in e.top_logprobs.items()}
            row[str(e.token_id)] = {"logprob": floored(e.logprob), "rank": e.rank,
                                    "decoded_token": token_text(e.token_id)}
            out.append(row)
        return out

    def logprobs(self, tokens: list[TokenInfo]) -> dict:
        if self.chat:
            return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": t.bytes,
                                 "top_logprobs": [{"token": s, "logprob": v, "bytes": b} for s, b, v in t.top]}
                                for t in tokens]}
        # completions: the sampled token is always among its top_logprobs (OpenAI's and vLLM's: up to N + 1 entries)
        return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [{s: v for s, _, v in t.top} | {t.text: t.logprob} for t in tokens],
                "text_offset": [t.offset for t in tokens]}
