"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status, and request ids.

Owns: APIError (raised anywhere in the HTTP layer, turned into a JSON response or an in-band SSE error event),
the constructors for each kind of failure, and the exception handlers that give FastAPI/Starlette's own errors
(unknown route, wrong method, anything unexpected) the same shape. `kind` labels the errors metric.
5xx messages pass through `redact()`: backend failures carry Ray's text (actor ids, pids, IPs, namespaces,
tracebacks, Python type names), which is logged in full server-side but never sent to the client; every other
message through coordinator.client_text.plain (no Python type names, input excerpts cut short), and `param` is
clipped (an unknown 7,000-character key is named by its first 100).

Request ids: `RequestIdMiddleware` takes the client's `X-Request-Id` (1-128 printable ASCII characters, no spaces;
anything else is a 400 naming the header) or generates one (`chatcmpl-<hex>`, `cmpl-<hex>`, `req-<hex>` by route),
puts it in `request.state.request_id` and the `REQUEST_ID` context variable, and returns it in an `X-Request-Id`
header on every response (success, SSE stream, every error). `RequestIdFilter` gives every log record a
`request_id` attribute from that variable ("-" outside a request), so every log line about a request names it.
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.client_text import ECHOED_CHARS, PYTHON_TYPE, clip, plain

logger = logging.getLogger("coordinator")
REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_LEN = 128
# set per request by RequestIdMiddleware; uvicorn runs every request in its own task, so it never leaks to another
REQUEST_ID: ContextVar[str | None] = ContextVar("pdserve_request_id", default=None)
_VALID_REQUEST_ID = re.compile(rf"^[\x21-\x7e]{{1,{MAX_REQUEST_ID_LEN}}}$")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str, kind: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = redact(message) if status >= 500 else plain(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.kind = kind  # metric label: invalid_request, auth, not_found, too_large, overloaded, draining, ...
        self.param = None if param is None else clip(param)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", "invalid_request", param, code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key (send `Authorization: Bearer <key>`)", "authentication_error",
                    "auth", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str, served: str) -> APIError:
    """404 for an unknown model; a 10 KB name is not sent back whole (clip: ECHOED_CHARS)."""
    return APIError(404, f"The model `{clip(model, ECHOED_CHARS)}` does not exist; this server serves `{served}`",
                    "invalid_request_error", "not_found", "model", "model_not_found")


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than the limit of {limit} bytes", "invalid_request_error",
                    "too_large", code="request_too_large")


def unavailable(message: str, retry_after_s: float, kind: str) -> APIError:
    retry = str(max(1, round(retry_after_s)))
    return APIError(503, message, "server_error", kind, code="service_unavailable", headers={"Retry-After": retry})


def unsupported_media_type(content_type: str | None) -> APIError:
    got = "no Content-Type header" if content_type is None else f"Content-Type {content_type[:100]!r}"
    return APIError(415, f"The request body must be JSON (Content-Type: application/json), got {got}",
                    "invalid_request_error", "unsupported_media_type", code="unsupported_media_type")


def request_timeout(seconds: float) -> APIError:
    return APIError(408, f"The request body was not received within {seconds:g} s", "invalid_request_error",
                    "request_timeout", code="request_timeout", headers={"Connection": "close"})


def backend_failure(message: str) -> APIError:
    """A 502 whose message is `message` redacted; the full text is logged (with the request id)."""
    logger.warning("backend failure: %s", message)
    return APIError(502, f"The model backend failed: {message}", "server_error", "backend", code="backend_error")


def timeout(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within {seconds:g} s", "server_error", "timeout",
                    code="timeout")


INTERNAL_MESSAGE = "Internal server error (logged by the server under this request's X-Request-Id)"


def internal(message: str) -> APIError:
    return APIError(500, message, "server_error", "internal", code="internal_error")


def install_handlers(app: FastAPI, on_error) -> None:
    """Every error response is OpenAI-shaped; `on_error(kind)` counts it."""

    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        on_error(exc.kind)
        return exc.response()

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request"
        err = APIError(exc.status_code, str(exc.detail), "invalid_request_error", kind,
                       headers=dict(exc.headers or {}))
        on_error(kind)
        return err.response()

    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        on_error("invalid_request")
        return invalid_request(str(exc.errors()[:1])).response()

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # runs outside RequestIdMiddleware (Starlette's outermost layer), so it adds the header itself
        rid = getattr(request.state, "request_id", None)
        logger.exception("unexpected error serving %s", request.url.path)
        on_error("internal")
        response = internal(INTERNAL_MESSAGE).response()
        if rid is not None:
            response.headers[REQUEST_ID_HEADER] = rid
        return response

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
    app.add_middleware(RequestIdMiddleware, on_error=on_error)



_TRACEBACK = re.compile(r'^\s*(Traceback \(most recent call last\):|File ".*", line \d+)')
_REDACTIONS = [  # (pattern, replacement), applied in order
    (re.compile(r"\bray::[\w.]+(?:\(\))?"), ""),  # the Ray task that failed ("ray::PrefillWorker.prefill()")
    # Ray's "(pid=123, ip=10.0.0.2, actor_id=..., repr=<... object at 0x...>)" after a task name
    (re.compile(r"\s*\((?=[^()]*\b(?:pid|ip|actor_id|node_id|worker_id|task_id|job_id)=)[^()]*\)"), ""),
    # ActorDiedError's field lines: "\tactor_id: ...", "\tpid: ...", "\tnamespace: ..."
    (re.compile(r"(?im)^\s*(?:actor_id|class_name|pid|ip|namespace|name|node_id|node_ip|worker_id|job_id|task_id)"
                r"\s*:.*$"), ""),
    (re.compile(r"(?i)\b(?:pid|ip|actor_id|node_id|node_ip|node_ip_address|worker_id|job_id|task_id)"
                r"\s*[=:]\s*[^\s,;)]+"), ""),
    (re.compile(r"(?i)\bnamespace\s*[=:]?\s*(?:'[^']*'|\"[^\"]*\"|[\w-]+)"), "namespace"),
    (re.compile(r"(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<id>"),
    (re.compile(r"(?i)\b0x[0-9a-f]+\b"), "<addr>"),
    (re.compile(r"(?i)\b[0-9a-f]{16,}\b"), "<id>"),  # actor, node, worker, job and object ids
    (re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b"), "<address>"),
    (re.compile(r"(?i)(?<![\w:])(?:[0-9a-f]{1,4}:){1,7}:(?:[0-9a-f]{1,4}(?::[0-9a-f]{1,4}){0,6})?(?![\w:])"
                r"|(?<![\w:])::[0-9a-f]{1,4}\b|\b(?:[0-9a-f]{1,4}:){7}[0-9a-f]{1,4}\b"), "<address>"),
    (re.compile(r"(?<![\w.<])/(?!admin/)(?:[\w.@+-]+/)+[\w.@+-]*"), "<path>/"),  # pdserve's own routes stay
    (re.compile(r"\s*,\s*(?=[,)])|\(\s*,\s*"), ""),  # separators left behind by the removals
]
MAX_REDACTED_LEN = 500


def redact(text: str) -> str:
    """`text` without pids, IPs, actor/node/worker ids, Ray namespaces, memory addresses, paths, tracebacks or
    Python type names: what may go to a client. The kind of failure and its explanation stay."""
    kept, skip_code = [], False
    for line in text.splitlines():
        if _TRACEBACK.match(line):
            skip_code = line.lstrip().startswith("File ")  # the source line printed under it goes too
            continue
        if skip_code and line.startswith("    "):
            skip_code = False
            continue
        skip_code = False
        kept.append(line)
    out = PYTHON_TYPE.sub("", "\n".join(kept))
    for pattern, replacement in _REDACTIONS:
        out = pattern.sub(replacement, out)
    out = re.sub(r"\s+", " ", out).strip()
    return out if len(out) <= MAX_REDACTED_LEN else out[:MAX_REDACTED_LEN - 3] + "..."


class RequestIdFilter(logging.Filter):
    """Gives every record a `request_id` attribute (the current request's, or "-") for `%(request_id)s`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get() or "-"
        return True


def _generated_id(path: str) -> str:
    prefix = "chatcmpl-" if path.endswith("/chat/completions") else "cmpl-" if path.endswith("/completions") else "req-"
    return prefix + uuid.uuid4().hex


class RequestIdMiddleware:
    """Pure ASGI (streams pass through untouched): the request id in, the `X-Request-Id` header out."""

    def __init__(self, app: ASGIApp, on_error) -> None:
        self.app = app
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"]
        valid = len(given) == 1 and _VALID_REQUEST_ID.match(given[0]) is not None
        rid = given[0] if valid else _generated_id(scope.get("path", ""))
        scope.setdefault("state", {})["request_id"] = rid
        REQUEST_ID.set(rid)
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", ()) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        if given and not valid:
            self.on_error("invalid_request")
            err = invalid_request(f"The {REQUEST_ID_HEADER} header must be one value of 1-{MAX_REQUEST_ID_LEN} "
                                  "printable ASCII characters without spaces", REQUEST_ID_HEADER)
            return await err.response()(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)
