"""The parse stage of a generation request: an HTTP request in, one InternalRequest out (or an OpenAI-shaped 4xx).

A request passes the API's stages once each (coordinator.api.app): parse (here), admit (a drain ticket and the
tenant's charge), generate (coordinator.api.lifecycle.Generation over the backend), shape (JSON or SSE:
coordinator.api.sse, tool_stream). Everything the later stages read about the request is on the InternalRequest,
so none of them goes back to the body, the OpenAI model's validation or the tokenizer.

Parse owns: the caller's tenant (its key), the draining check, the body (size and read-time limits), its validation
into the OpenAI model (coordinator.api.protocol), the served model's name, and for a single-choice request the
prompt's token ids (chat template; a long prompt is tokenized off the event loop), max_tokens against the context
and the engine's SamplingParams. A request with several choices (n, best_of, echo, prompt lists, prompt_logprobs)
is parsed to its OpenAI model only: coordinator.api.choices builds one generation per choice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from coordinator import errors
from coordinator.admission.tenants import Tenant
from coordinator.api import choices, engine_inputs, protocol, reasoning
from coordinator.api.http_body import read_json
from coordinator.api.model_api import accepts
from engine.core.sampling_params import SamplingParams

REQUEST_LOG = logging.getLogger("coordinator.requests")


@dataclass(frozen=True)
class InternalRequest:
    openai: Any                      # the validated body: protocol.ChatCompletionRequest | protocol.CompletionRequest
    chat: bool
    tenant: Tenant
    request_id: str                  # the client's X-Request-Id or one generated (errors.RequestIdMiddleware)
    arrival: float                   # monotonic seconds when it arrived
    prompt: list[int] | None = None  # None: several choices, each built by coordinator.api.choices
    max_tokens: int = 0
    num_logprobs: int | None = None  # logprobs asked for (chat's top_logprobs or completions' logprobs)
    params: SamplingParams | None = None
    traceparent: str | None = None   # the client's W3C trace context, continued by the request's spans
    max_tokens_given: bool = True    # False: max_tokens is the rest of the context (chat without max_tokens)

    @property
    def multi_choice(self) -> bool:
        return self.prompt is None

    @property
    def priority(self) -> int:
        return self.tenant.priority_for(self.openai.priority)


async def parse_request(app: FastAPI, request: Request, chat: bool) -> InternalRequest:
    """The request as every later stage reads it; an APIError (4xx) for anything invalid."""
    settings, backend = app.state.settings, app.state.backend
    arrival = time.monotonic()
    tenant = app.state.tenants.authenticate(request.headers.get("authorization"))
    if app.state.lifecycle.draining:
        app.state.lifecycle.admit()  # raises the draining 503
    model = protocol.ChatCompletionRequest if chat else protocol.CompletionRequest
    req = protocol.parse(model, await read_json(request, settings.max_body_bytes, settings.body_read_timeout_s))
    if not accepts(app.state, req.model):
        raise errors.model_not_found(req.model, app.state.model_name)
    if chat:  # a structured output or forced tool call would constrain the reasoning too
        reasoning.refuse_constraints(settings.reasoning_parser, req)
    request_id: str = request.state.request_id
    if req.user is not None or req.metadata:  # accepted only to be logged (protocol's docstring); the record has the id
        REQUEST_LOG.info("user=%r metadata=%r", req.user, req.metadata)
    if choices.wanted(req):
        if req.include_phases:
            raise errors.invalid_request("stream_options.include_phases: only for single-choice requests (not with "
                                         "n > 1, best_of, echo, prompt lists or prompt_logprobs)",
                                         "stream_options.include_phases")
        return InternalRequest(req, chat, tenant, request_id, arrival)
    args = (req, app.state.tokenizer, backend.vocab_size, settings.allow_special_tokens_in_content)
    if engine_inputs.tokenize_inline(req):  # cheaper here than a hop to a thread
        prompt = engine_inputs.prompt_token_ids(*args)
    else:  # a long prompt: off the loop, so it does not stall every stream
        prompt = await asyncio.to_thread(engine_inputs.prompt_token_ids, *args)
    max_tokens = engine_inputs.max_tokens(req, len(prompt), backend.max_model_len)
    given = (req.requested_max_tokens if chat else req.max_tokens) is not None
    num_logprobs = req.num_logprobs if chat else req.logprobs
    params = engine_inputs.sampling_params(req, max_tokens, num_logprobs, app.state.tokenizer, backend.vocab_size)
    return InternalRequest(req, chat, tenant, request_id, arrival, prompt, max_tokens, num_logprobs, params,
                           request.headers.get("traceparent"), given)
