"""serve_single: the shape stage of a single-choice request once admitted (coordinator.api.app): the whole JSON
response or the SSE stream, tool calls shaped in either (coordinator.api.tool_stream), and the one cleanup every exit
path runs: the Generation closed with the request's outcome (and the finish reason the client got, tool_calls
included, for the metrics) and the ticket released. Requests with several
choices: coordinator.api.choices_serve."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from coordinator import errors
from coordinator.api.drain import Ticket
from coordinator.api.lifecycle import Generation
from coordinator.api.sse import DONE, Formatter, SSEResponse, event
from coordinator.api.tool_stream import ToolStream, shape_response, tool_chunks, tool_stream_for


def outcome_of(exc: BaseException) -> str:
    """The outcome a request that ended with `exc` is counted with."""
    if isinstance(exc, errors.APIError):
        return {"timeout": "timeout", "overloaded": "rejected", "unavailable": "rejected"}.get(exc.kind, "failed")
    return "aborted" if isinstance(exc, asyncio.CancelledError) else "failed"


async def serve_single(app: FastAPI, request: Request, req: Any, gen: Generation, fmt: Formatter, ticket: Ticket, *,
                       chat: bool, until_disconnect: Callable[..., Awaitable[Any]], grace_s: float) -> Response:
    want_lp = gen.request.params.logprobs is not None
    tools = tool_stream_for(req, app.state.settings.tool_call_parser) if chat else None
    try:
        result = await until_disconnect(request, gen.next_piece if req.stream else gen.collect)
    except BaseException as e:
        await gen.close(outcome_of(e))
        ticket.release()
        raise
    if result is None or not req.stream:
        try:  # the body first: its finish reason (tool_calls) is the one the request is counted with
            body = None if result is None else _response_body(fmt, gen, result, want_lp, tools)
        except BaseException:
            await gen.close("failed")
            ticket.release()
            raise
        gen.client_finish = None if body is None else body["choices"][0]["finish_reason"]
        await gen.close("aborted" if body is None else "finished")
        ticket.release()
        if body is None:
            return Response(status_code=499)  # nobody is listening
        return JSONResponse(body)
    events = _events(gen, fmt, result, want_lp, ticket, app.state.metrics.errors.inc, tools)
    return SSEResponse(events, deadline=gen.deadline + grace_s, stall=app.state.stall_policy)


def _response_body(fmt: Formatter, gen: Generation, result: list[Any], want_lp: bool,
                   tools: ToolStream | None) -> dict:
    """A whole (not streamed) response's body, with its tool calls when the request has tools."""
    tokens = [t for p in result for t in p.tokens]
    split = gen.reasoning  # with a reasoning parser, the pieces' text is the content and their reasoning apart
    body = fmt.response("".join(p.text for p in result), tokens, want_lp, gen.finish_reason or "stop",
                        gen.prompt_tokens, gen.completion_tokens, [i for p in result for i in p.token_ids],
                        "".join(p.reasoning for p in result) if split is not None and split.opened else None,
                        reasoning_tokens(fmt, gen), gen.cached_tokens)
    if tools is not None:
        body = shape_response(body, tools.mode, tools.parser, tools.named, tools.parallel)
    return body


def reasoning_tokens(fmt: Formatter, gen: Generation) -> int | None:
    """usage's completion_tokens_details.reasoning_tokens: with a reasoning parser only (vLLM's)."""
    if not fmt.reasoning:
        return None
    return 0 if gen.reasoning is None else gen.reasoning.tokens


async def _events(gen: Generation, fmt: Formatter, first: Any, want_lp: bool, ticket: Ticket,
                  on_error: Callable[[str], None], tools: ToolStream | None = None) -> AsyncIterator[bytes]:
    outcome = "aborted"  # unless the stream gets to its end
    try:
        piece = first
        for chunk in _chunks(fmt, tools, piece, want_lp, gen, first=True):
            yield chunk
        while piece.finish_reason is None:
            piece = await gen.next_piece()
            if (piece.text or piece.tokens or piece.finish_reason or piece.reasoning
                    or (fmt.return_token_ids and piece.token_ids)):
                for chunk in _chunks(fmt, tools, piece, want_lp, gen):
                    yield chunk
        if fmt.include_usage:
            phases = gen.trace.snapshot() if fmt.include_phases and gen.trace is not None else None
            yield event(fmt.usage_chunk(gen.prompt_tokens, gen.completion_tokens, phases, reasoning_tokens(fmt, gen),
                                        gen.cached_tokens))
        outcome = "finished"
        yield DONE
    except errors.APIError as e:
        outcome = outcome_of(e)
        on_error(e.kind)
        yield event(e.body())
        yield DONE
    except Exception:  # a bug, not the client's or the backend's doing: still end the stream properly
        errors.logger.exception("stream %s failed", fmt.id)
        outcome = "failed"
        on_error("internal")
        yield event(errors.internal(errors.INTERNAL_MESSAGE).body())
        yield DONE
    finally:
        try:
            await gen.close(outcome)  # shielded inside: a disconnect at [DONE] cannot cut it short
        finally:
            ticket.release()


def _chunks(fmt: Formatter, tools: ToolStream | None, piece: Any, lp: bool, gen: Generation,
            first: bool = False) -> list[bytes]:
    if tools is None:
        return [fmt.chunk_event(piece, lp, first)]  # from a template for a plain text chunk (coordinator.api.sse)
    chunks = tool_chunks(fmt.chunk(piece, lp, first), tools, piece.text, piece.finish_reason, first)
    if piece.finish_reason is not None:  # the reason the client gets (tool_calls) is the one counted
        gen.client_finish = chunks[-1]["choices"][0]["finish_reason"]
    return list(map(event, chunks))
