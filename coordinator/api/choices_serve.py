"""serve_choices: the HTTP side of coordinator.api.choices: admission (ticket, tenant limits), the whole JSON response
or the SSE stream (every chunk carries its choice's index), and the one cleanup every exit path runs: every
choice's Generation closed (an abort of what is unfinished), the ticket released, the tenant charged once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from coordinator import errors
from coordinator.api.choices import Choice, best, build, cached_tokens, logprobs_body, usage
from coordinator.api.lifecycle import Piece
from coordinator.api.sse import DONE, Formatter, SSEResponse, event
from coordinator.api.tool_stream import ToolStream, shape_choice, tool_chunks, tool_stream_for


async def serve_choices(app: Any, request: Request, req: Any, tenant: Any, arrival: float, *, chat: bool,
                        until_disconnect: Callable[..., Awaitable[Any]], grace_s: float) -> Response:
    request_id: str = request.state.request_id
    choices = await asyncio.to_thread(build, app, req, chat, request_id, tenant.priority_for(req.priority), arrival,
                                      tenant.stream_interval(app.state.settings.stream_interval))
    fmt = Formatter(chat, app.state.model_name, req.include_usage, request_id,
                    return_token_ids=bool(req.return_token_ids),
                    reasoning=chat and app.state.settings.reasoning_parser is not None)
    ticket = app.state.lifecycle.admit()
    try:
        grant = await app.state.tenants.charge(tenant,
                                               sum({id(c.fanout): len(c.prompt_ids) for c in choices}.values()),
                                               sum(c.gen.request.params.max_tokens for c in choices))
    except BaseException:
        ticket.release()
        raise

    async def close(outcome: str) -> None:
        # A client that drops the connection at [DONE] (the openai client does) cancels the stream while this
        # runs: the choices' closes are shielded (each bounds its own wait) and the ticket and the tenant's charge
        # are given back whatever happens, or a drain waits out its timeout and the tenant's in-flight count leaks.
        try:
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*[c.gen.close(outcome) for c in choices])
        finally:
            ticket.release()
            if grant is not None:
                grant.settle(usage(choices)[1], outcome, prompt_processed=True)

    want_lp = (req.num_logprobs if chat else req.logprobs) is not None
    echo_lp = not chat and req.echo and want_lp
    if not req.stream:
        async def collect_all() -> bool:
            for c, pieces in zip(choices, await asyncio.gather(*[c.gen.collect() for c in choices]), strict=True):
                c.pieces = pieces
            return True
        try:
            done = await until_disconnect(request, collect_all)
        except BaseException:
            await close("failed")
            raise
        if not done:
            await close("aborted")
            return Response(status_code=499)
        try:  # the bodies first: their finish reasons (tool_calls) are the ones the choices are counted with
            body = _whole_body(choices, fmt, req, chat, want_lp, echo_lp, app.state.settings.tool_call_parser)
        except BaseException:
            await close("failed")
            raise
        await close("finished")
        return JSONResponse(body)
    tools = {c.index: tool_stream_for(req, app.state.settings.tool_call_parser) for c in choices} if chat else {}
    return SSEResponse(_events(choices, fmt, req, chat, want_lp, echo_lp, close, tools),
                       deadline=max(c.gen.deadline for c in choices) + grace_s, stall=app.state.stall_policy)


def _whole_body(choices: list[Choice], fmt: Formatter, req: Any, chat: bool, want_lp: bool, echo_lp: bool,
                parser: str) -> dict:
    """The whole (not streamed) response: the n best choices, each with its tool calls when the request has tools."""
    n = req.n or 1
    kept = best(choices, n, len(choices) // len({id(c.fanout) for c in choices}))
    bodies, top = [], {}
    for c in kept:
        whole = Piece("".join(p.text for p in c.pieces), [t for p in c.pieces for t in p.tokens],
                      c.gen.finish_reason, [i for p in c.pieces for i in p.token_ids])
        lp = logprobs_body(fmt, c, whole, True, echo_lp) if want_lp else None
        thought = "".join(p.reasoning for p in c.pieces) if c.gen.reasoning and c.gen.reasoning.opened else None
        body = fmt.choice(c.index, c.prompt_text + whole.text, lp, whole.finish_reason or "stop", False,
                          reasoning=thought)
        tools = tool_stream_for(req, parser) if chat else None
        if tools is not None:
            shape_choice(body, tools.mode, tools.parser, tools.named, tools.parallel)
            c.gen.client_finish = body["finish_reason"]
        fmt.add_token_ids(top, body, whole.token_ids, c.prompt_ids, whole=True)  # chat's go on the response
        if not chat:  # vLLM's: on each completion choice, on the chat response; null unless asked for
            body["prompt_logprobs"] = _prompt_lps(c) if req.prompt_logprobs is not None else None
        bodies.append(body)
    extra = {"prompt_logprobs": _prompt_lps(choices[0]) if req.prompt_logprobs is not None else None} if chat else {}
    return fmt.body(bodies, False, usage(choices, fmt.reasoning), cached_tokens(choices), **extra, **top)


def _prompt_lps(c: Choice) -> list | None:
    return Formatter.prompt_logprobs(c.fanout.prompt_logprobs or [], lambda t: c.gen.text.token_text(t)[0])


async def _events(choices: list[Choice], fmt: Formatter, req: Any, chat: bool, want_lp: bool, echo_lp: bool,
                  close: Callable[[str], Awaitable[None]], tools: dict[int, ToolStream | None]
                  ) -> AsyncIterator[bytes]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            while True:
                piece = await c.gen.next_piece()
                queue.put_nowait((c, piece))
                if piece.finish_reason is not None:
                    return
        except BaseException as e:  # noqa: BLE001 - the stream ends with it
            queue.put_nowait((c, e))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    outcome, started, left = "aborted", set(), len(choices)
    sent = dict.fromkeys((c.index for c in choices), 0)  # each choice's tokens that reached a chunk (usage's count)
    try:
        while left:
            c, piece = await queue.get()
            if isinstance(piece, BaseException):
                raise piece
            first = c.index not in started
            started.add(c.index)
            left -= piece.finish_reason is not None
            sent[c.index] += len(piece.token_ids)
            if not (first or piece.text or piece.tokens or piece.finish_reason or piece.reasoning
                    or (fmt.return_token_ids and piece.token_ids)):
                continue
            lp = logprobs_body(fmt, c, piece, first, echo_lp) if want_lp else None
            body = fmt.choice(c.index, (c.prompt_text if first else "") + piece.text, lp, piece.finish_reason,
                              True, first, piece.reasoning)
            extra: dict = {}
            if first and req.prompt_logprobs is not None:
                if chat:
                    extra["prompt_logprobs"] = _prompt_lps(c)
                else:
                    body["prompt_logprobs"] = _prompt_lps(c)
            fmt.add_token_ids(extra, body, piece.token_ids, c.prompt_ids if first else None)
            chunk = fmt.body([body], True, **extra)
            if req.continuous_usage:  # vLLM's, with several choices: each chunk its own choice's usage so far
                chunk["usage"] = fmt.usage(len(c.prompt_ids), sent[c.index], cached_tokens=c.gen.cached_tokens)
            stream = tools.get(c.index)
            if stream is None:
                yield event(chunk)
                continue
            chunks = tool_chunks(chunk, stream, piece.text, piece.finish_reason, first)
            if piece.finish_reason is not None:  # the reason the client gets (tool_calls) is the one counted
                c.gen.client_finish = chunks[-1]["choices"][0]["finish_reason"]
            for part in chunks:
                yield event(part)
        if fmt.include_usage:
            yield event(fmt.usage_chunk(*usage(choices)[:2], reasoning_tokens=(usage(choices, True)[2]
                                                                               if fmt.reasoning else None),
                                        cached_tokens=cached_tokens(choices)))
        outcome = "finished"
        yield DONE
    except errors.APIError as e:
        outcome = "failed"
        yield event(e.body())
        yield DONE
    except Exception:  # a bug: still end the stream properly
        errors.logger.exception("stream %s failed", fmt.id)
        outcome = "failed"
        yield event(errors.internal(errors.INTERNAL_MESSAGE).body())
        yield DONE
    finally:
        for t in tasks:
            t.cancel()
        try:
            with anyio.CancelScope(shield=True):  # the pumps end at once when cancelled (they catch it)
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await close(outcome)
