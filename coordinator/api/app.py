"""create_app: the coordinator's OpenAI-compatible HTTP API over a ServingBackend.

Owns the HTTP edge and the order of a generation request's stages, each visited once: parse (auth, body limits,
validation, tokenization, the context-length check: coordinator.api.internal_request; every rejection is an
OpenAI-shaped 4xx and never reaches the backend), admit (a drain ticket and the tenant's charge:
coordinator.admission.tenants), generate (a Generation over the backend: coordinator.api.lifecycle) and shape
(coordinator.api.single_serve: a JSON response or an SSE stream, whose final usage chunk carries the request's
phases when `stream_options.include_phases` asks: coordinator.observability.phases). A request with several choices
goes from parse to coordinator.api.choices_serve, which admits, generates and shapes its choices together. Routes:
POST /v1/completions, POST /v1/chat/completions, GET /health (503 while draining or while a pool has no live
worker), GET /metrics, /admin/* when server.admin_api is on (coordinator.api.admin), and GET /v1/models, GET
/version, POST /tokenize, POST /detokenize (coordinator.api.model_api). State lives on app.state: backend, settings,
tokenizer, lifecycle (drain API, see coordinator.api.drain), metrics, tenants, stall_policy (streams whose client
stopped reading: coordinator.api.stall_watch). The caller owns the backend: it awaits `backend.start()` before
serving and `backend.shutdown()` after, and drains first (coordinator.api.drain); the app's lifespan only marks the
server draining when uvicorn shuts down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from coordinator import errors
from coordinator.admission.tenants import TenantRegistry
from coordinator.api import model_api, reasoning
from coordinator.api.admin import health_response, install_admin_routes
from coordinator.api.admin_fleet import install_fleet_routes
from coordinator.api.choices_serve import serve_choices
from coordinator.api.drain import Lifecycle, Ticket
from coordinator.api.internal_request import InternalRequest, parse_request
from coordinator.api.lifecycle import Generation
from coordinator.api.single_serve import serve_single
from coordinator.api.sse import DirectStreamAPI, Formatter
from coordinator.api.stall_watch import StallPolicy
from coordinator.api.text_output import TextOutput
from coordinator.config.settings import ServerSettings, tracing_on
from coordinator.config.tenants_config import TenantsConfig
from coordinator.contract import GenerateRequest, ServingBackend
from coordinator.observability.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from coordinator.observability.metrics import Metrics
from coordinator.observability.phases import PhaseTrace
from coordinator.observability.shared_scrapes import SharedScrapes
from coordinator.observability.tracing import RequestSpan, RequestTracer
from engine.text.tokenizer import Tokenizer

T = TypeVar("T")
STREAM_DEADLINE_GRACE_S = 1.0  # past the request's deadline, a stream blocked on a slow reader is cut


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of `model` (`tiny`, built if needed, or a checkpoint folder)."""
    from engine.tiny import resolve_model_path  # building `tiny` imports torch: only where it is asked for
    return Tokenizer.from_folder(resolve_model_path(model))


def create_app(backend: ServingBackend, settings: ServerSettings, tenants: TenantsConfig | None = None,
               registry: TenantRegistry | None = None, tokenizer: Tokenizer | None = None) -> FastAPI:
    """The app over `backend`. `registry`: the tenants' live state, when it is not this process's own (an HTTP
    frontend process charges the core's: coordinator.frontends); by default one made from `tenants`. `tokenizer`:
    the model's, read already (coordinator.serve reads it while the workers start); by default read here."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        anyio.create_task_group()  # anyio imports its asyncio backend on first use: here, not in the first stream
        yield
        app.state.lifecycle.begin_drain()
        if app.state.tracer is not None:
            app.state.tracer.shutdown()

    app = DirectStreamAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    app.state.settings = settings
    app.state.model_name = model_api.model_id(backend.model_name, backend.model_path, settings.served_model_name)
    app.state.tokenizer = tokenizer or load_tokenizer(backend.model_path)
    app.state.lifecycle = Lifecycle()
    app.state.metrics = Metrics(app.state.model_name, backend.max_model_len)
    app.state.tenants = registry or TenantRegistry(tenants or TenantsConfig(), settings.api_key)  # one key, or tenants'
    app.state.metrics.watch(backend, app.state.lifecycle, app.state.tenants)  # read afresh at each scrape
    app.state.tracer = RequestTracer(settings.otlp_traces_endpoint, settings.traces_file,
                                     settings.trace_sample_ratio) if tracing_on(settings) else None
    app.state.stall_policy = StallPolicy(settings.stall_timeout_s, app.state.metrics.stalled_clients.inc)
    errors.install_handlers(app, app.state.metrics.errors.inc)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """Open to all: status and each worker's name, role, state and restarts; with the operator's key also
        pids, hosts and why workers died (internals no client should read)."""
        return health_response(backend, app.state.lifecycle.draining, _is_operator(settings, request))

    if settings.admin_api:
        install_admin_routes(app, lambda request: _check_operator(app, request))
        install_fleet_routes(app, lambda request: _check_operator(app, request))  # revive, rolling restart

    async def exposition(tenants: bool) -> bytes:
        refresh = getattr(backend, "refresh", None)  # an HTTP frontend process: the core's figures and the other
        others = await refresh() if refresh is not None else ()  # frontends' shares (coordinator.frontends)
        return await app.state.metrics.exposition_async(others, tenants)

    scrapes = SharedScrapes(exposition)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Open to all, but the tenant-labelled families (tenants' names and usage) only with the operator's key or
        server.metrics_api_key; concurrent scrapes share a build, built at a bounded rate and never before the
        scrape arrived (coordinator.observability.shared_scrapes)."""
        full = _is_operator(settings, request) or _bearer_is(request, settings.metrics_api_key)
        return Response(await scrapes.get(full), media_type=METRICS_CONTENT_TYPE)

    app.include_router(model_api.router)  # /v1/models, /version, /tokenize, /detokenize

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(app, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(app, request, chat=True)

    return app


def _is_operator(settings: ServerSettings, request: Request) -> bool:
    """Whether the request carries the operator's key (server.admin_api_key), compared in constant time."""
    return _bearer_is(request, settings.admin_api_key)


def _bearer_is(request: Request, key: str | None) -> bool:
    """Whether the request's `Authorization: Bearer` is `key` (never when `key` is None), in constant time."""
    if key is None:
        return False
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _check_operator(app: FastAPI, request: Request) -> None:
    """/admin/*: the operator's key; a client's or tenant's valid key is not one (403: known, not allowed); no key or
    an unknown one, 401."""
    if _is_operator(app.state.settings, request):
        return
    header = request.headers.get("authorization")
    if header:
        try:
            app.state.tenants.authenticate(header)
        except errors.APIError:
            pass
        else:
            raise errors.APIError(403, "This route needs the operator's key (server.admin_api_key); a client's key "
                                  "is not one", "permission_error", "forbidden", code="operator_key_required")
    raise errors.APIError(401, "This route needs the operator's key (server.admin_api_key)",
                          "authentication_error", "auth", code="invalid_api_key")


async def _until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """Run `work`, cancelling it if the client disconnects first (then None). Its exceptions propagate as they are."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled: so is the work (its cancellation closes the stream)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # its cleanup (closing the backend stream) has run when this returns
    return None


async def _serve(app: FastAPI, request: Request, chat: bool) -> Response:
    """One generation request through the stages, each once: parse, admit, generate, shape."""
    try:
        internal = await parse_request(app, request, chat)
        if internal.multi_choice:  # n, best_of, prompt lists, echo, prompt_logprobs: coordinator.api.choices_serve
            return await serve_choices(app, request, internal.openai, internal.tenant, internal.arrival, chat=chat,
                                       until_disconnect=_until_disconnect, grace_s=STREAM_DEADLINE_GRACE_S)
        ticket, grant, internal = await _admit(app, internal)
    except errors.APIError:
        app.state.metrics.requests.inc("rejected")
        raise
    try:
        gen = _generate(app, internal, grant)
        fmt = _formatter(app, internal, gen)
    except BaseException:
        ticket.release()
        raise
    return await serve_single(app, request, internal.openai, gen, fmt, ticket, chat=internal.chat,
                              until_disconnect=_until_disconnect, grace_s=STREAM_DEADLINE_GRACE_S)


async def _admit(app: FastAPI, internal: InternalRequest) -> tuple[Ticket, Any, InternalRequest]:
    """A drain ticket (refused while draining), the tenant's charge (429 past its limits) and the request as
    admitted: without max_tokens, its output capped at what the tenant's limit allows (Grant.output_tokens)."""
    ticket = app.state.lifecycle.admit()
    try:
        grant = await app.state.tenants.charge(internal.tenant, len(internal.prompt), internal.max_tokens,
                                               internal.max_tokens_given, internal.params.min_tokens)
    except BaseException:
        ticket.release()
        raise
    if grant.output_tokens < internal.max_tokens:
        params = dataclasses.replace(internal.params, max_tokens=grant.output_tokens)
        internal = dataclasses.replace(internal, max_tokens=grant.output_tokens, params=params)
    return ticket, grant, internal


def _generate(app: FastAPI, internal: InternalRequest, grant: Any) -> Generation:
    """The request's run on the backend, with its text (detokenizer, stop strings) and phases."""
    req, settings = internal.openai, app.state.settings
    text = TextOutput(app.state.tokenizer, internal.prompt, req.stop_strings, req.include_stop_str_in_output,
                      req.skip_special_tokens, req.min_tokens, bool(req.return_tokens_as_token_ids))
    trace = PhaseTrace(internal.arrival)
    generate = GenerateRequest(internal.request_id, internal.prompt, internal.params, internal.priority, trace=trace,
                               stream_interval=internal.tenant.stream_interval(settings.stream_interval))
    tracer = app.state.tracer
    span = None if tracer is None else RequestSpan(tracer, internal.traceparent, app.state.model_name)
    split = reasoning.for_request(settings.reasoning_parser, req) if internal.chat else None
    return Generation(app.state.backend, generate, text, app.state.metrics, settings.request_timeout_s,
                      internal.num_logprobs is not None, internal.arrival, grant, trace=trace, span=span,
                      reasoning=split)


def _formatter(app: FastAPI, internal: InternalRequest, gen: Generation) -> Formatter:
    """How the shape stage writes this request's chunks and body (coordinator.api.sse)."""
    req = internal.openai
    fmt = Formatter(internal.chat, app.state.model_name, req.include_usage, internal.request_id, req.include_phases,
                    bool(req.return_token_ids), internal.prompt,
                    internal.chat and app.state.settings.reasoning_parser is not None)
    if req.continuous_usage:
        fmt.usage_so_far = lambda: (gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
    return fmt
