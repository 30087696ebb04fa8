"""create_app: the coordinator's OpenAI-compatible HTTP API over a ServingBackend.

Owns the HTTP edge: auth (one server key, or tenants' keys with their rate limits and priority:
coordinator.admission.tenants),
body limits, parsing and validation (every rejection is an OpenAI-shaped 4xx and never reaches the backend),
tokenization (once, here; chat template for chat requests), the context-length check, and handing the admitted request
to coordinator.api.single_serve (a JSON response or an SSE stream, whose final usage chunk carries the request's
phases when `stream_options.include_phases` asks: coordinator.observability.phases) or, with several choices, to
coordinator.api.choices_serve. Routes: POST /v1/completions, POST
/v1/chat/completions,
GET /health (503 while draining or while a pool has no live worker), GET /metrics, /admin/* when server.admin_api is
on (coordinator.api.admin), and GET /v1/models, GET /version, POST /tokenize, POST /detokenize
(coordinator.api.model_api).
State lives on app.state: backend, settings, tokenizer, lifecycle (drain API, see coordinator.api.drain), metrics,
tenants. The caller owns the backend: it awaits `backend.start()` before serving and `backend.shutdown()` after, and
drains first (coordinator.api.drain); the app's lifespan only marks the server draining when uvicorn shuts down.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response

from coordinator import errors
from coordinator.admission.tenants import Tenant, TenantRegistry
from coordinator.api import choices, model_api, protocol
from coordinator.api.admin import health_response, install_admin_routes
from coordinator.api.choices_serve import serve_choices
from coordinator.api.drain import Lifecycle, Ticket
from coordinator.api.http_body import read_json
from coordinator.api.lifecycle import Generation
from coordinator.api.single_serve import serve_single
from coordinator.api.sse import DirectStreamAPI, Formatter
from coordinator.api.text_output import TextOutput
from coordinator.config.settings import ServerSettings
from coordinator.config.tenants_config import TenantsConfig
from coordinator.contract import GenerateRequest, ServingBackend
from coordinator.observability.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from coordinator.observability.metrics import Metrics
from coordinator.observability.phases import PhaseTrace
from engine.text.tokenizer import Tokenizer

T = TypeVar("T")
REQUEST_LOG = logging.getLogger("coordinator.requests")
STREAM_DEADLINE_GRACE_S = 1.0  # past the request's deadline, a stream blocked on a slow reader is cut


def load_tokenizer(model_path: str) -> Tokenizer:
    if model_path == "tiny":  # the embedded model: resolving it imports torch, so only then
        from engine.tiny import resolve_model_path
        model_path = str(resolve_model_path(model_path))
    return Tokenizer.from_folder(model_path)


def create_app(backend: ServingBackend, settings: ServerSettings, tenants: TenantsConfig | None = None,
               registry: TenantRegistry | None = None) -> FastAPI:
    """The app over `backend`. `registry`: the tenants' live state, when it is not this process's own (an HTTP
    frontend process charges the core's: coordinator.frontends); by default one made from `tenants`."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        anyio.create_task_group()  # anyio imports its asyncio backend on first use: here, not in the first stream
        yield
        app.state.lifecycle.begin_drain()

    app = DirectStreamAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    app.state.settings = settings
    app.state.model_name = settings.served_model_name or backend.model_name
    app.state.tokenizer = load_tokenizer(backend.model_path)
    app.state.lifecycle = Lifecycle()
    app.state.metrics = Metrics(app.state.model_name, backend.max_model_len)
    app.state.tenants = registry or TenantRegistry(tenants or TenantsConfig(), settings.api_key)  # one key, or tenants'
    app.state.metrics.watch(backend, app.state.lifecycle, app.state.tenants)  # read afresh at each scrape
    errors.install_handlers(app, app.state.metrics.errors.inc)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """Open to all: status and each worker's name, role, state and restarts; with the operator's key also
        pids, hosts and why workers died (internals no client should read)."""
        return health_response(backend, app.state.lifecycle.draining, _is_operator(settings, request))

    if settings.admin_api:
        install_admin_routes(app, lambda request: _check_operator(settings, request))

    @app.get("/metrics")
    async def metrics() -> Response:
        refresh = getattr(backend, "refresh", None)  # an HTTP frontend process: the core's figures and the other
        others = await refresh() if refresh is not None else ()  # frontends' shares (coordinator.frontends)
        return Response(await app.state.metrics.exposition_async(others), media_type=METRICS_CONTENT_TYPE)

    app.include_router(model_api.router)  # /v1/models, /version, /tokenize, /detokenize

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(app, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(app, request, chat=True)

    return app


def _authenticate(app: FastAPI, request: Request) -> Tenant:
    """The request's tenant from its `Authorization: Bearer` key (401 if the server has keys and it has none)."""
    return app.state.tenants.authenticate(request.headers.get("authorization"))


def _is_operator(settings: ServerSettings, request: Request) -> bool:
    """Whether the request carries the operator's key (server.admin_api_key), compared in constant time."""
    if settings.admin_api_key is None:
        return False
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), settings.admin_api_key.encode())


def _check_operator(settings: ServerSettings, request: Request) -> None:
    """/admin/*: the operator's key or a 401 (any other key, a tenant's included, is not an operator's)."""
    if not _is_operator(settings, request):
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


async def _admit(app: FastAPI, request: Request, chat: bool) -> tuple[Any, Generation, Formatter, Ticket]:
    """Everything before the backend: a rejected request raises an APIError here and never reaches it."""
    settings: ServerSettings = app.state.settings
    backend: ServingBackend = app.state.backend
    arrival = time.monotonic()
    tenant = _authenticate(app, request)
    if app.state.lifecycle.draining:
        app.state.lifecycle.admit()  # raises the draining 503
    model = protocol.ChatCompletionRequest if chat else protocol.CompletionRequest
    req = protocol.parse(model, await read_json(request, settings.max_body_bytes, settings.body_read_timeout_s))
    if req.model != app.state.model_name:
        raise errors.model_not_found(req.model, app.state.model_name)
    if choices.wanted(req):  # n, best_of, prompt lists, echo, prompt_logprobs: coordinator.api.choices_serve
        for option in ("include_phases", "continuous_usage_stats"):
            if getattr(req.stream_options, option, False):
                raise errors.invalid_request(f"stream_options.{option}: only for single-choice requests (not with "
                                             "n > 1, best_of, echo, prompt lists or prompt_logprobs)",
                                             f"stream_options.{option}")
        return req, tenant, arrival
    args = (req, app.state.tokenizer, backend.vocab_size, settings.allow_special_tokens_in_content)
    if protocol.tokenize_inline(req):  # cheaper here than a hop to a thread
        prompt = protocol.prompt_token_ids(*args)
    else:  # a long prompt: off the loop, so it does not stall every stream
        prompt = await asyncio.to_thread(protocol.prompt_token_ids, *args)
    max_tokens = protocol.max_tokens(req, len(prompt), backend.max_model_len)
    num_logprobs = req.num_logprobs if chat else req.logprobs
    params = protocol.sampling_params(req, max_tokens, num_logprobs, app.state.tokenizer, backend.vocab_size)
    request_id: str = request.state.request_id  # errors.RequestIdMiddleware: the client's X-Request-Id or generated
    if req.user is not None or req.metadata:  # accepted only to be logged (protocol's docstring); the record has the id
        REQUEST_LOG.info("user=%r metadata=%r", req.user, req.metadata)
    priority = tenant.priority_for(req.priority)
    fmt = Formatter(chat, app.state.model_name, req.include_usage, request_id, req.include_phases,
                    bool(req.return_token_ids), prompt)
    text = TextOutput(app.state.tokenizer, prompt, req.stop_strings, req.include_stop_str_in_output,
                      req.skip_special_tokens, req.min_tokens, bool(req.return_tokens_as_token_ids))
    ticket = app.state.lifecycle.admit()
    try:
        grant = await app.state.tenants.charge(tenant, len(prompt), max_tokens)  # 429 past the tenant's limits
    except BaseException:
        ticket.release()
        raise
    trace = PhaseTrace(arrival)
    generate = GenerateRequest(request_id, prompt, params, priority, trace=trace,
                               stream_interval=tenant.stream_interval(settings.stream_interval))
    gen = Generation(app.state.backend, generate, text, app.state.metrics, settings.request_timeout_s,
                     num_logprobs is not None, arrival, grant, trace=trace)
    if req.continuous_usage:
        fmt.usage_so_far = lambda: (gen.prompt_tokens, gen.completion_tokens)
    return req, gen, fmt, ticket


async def _serve(app: FastAPI, request: Request, chat: bool) -> Response:
    try:
        admitted = await _admit(app, request, chat)
        if len(admitted) == 3:
            return await serve_choices(app, request, *admitted, chat=chat, until_disconnect=_until_disconnect,
                                       grace_s=STREAM_DEADLINE_GRACE_S)
    except errors.APIError:
        app.state.metrics.requests.inc("rejected")
        raise
    return await serve_single(app, request, *admitted, chat=chat, until_disconnect=_until_disconnect,
                              grace_s=STREAM_DEADLINE_GRACE_S)
