"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Owns: APIError (raised anywhere in the HTTP layer, turned into a JSON response or an in-band SSE error event),
the constructors for each kind of failure, and the exception handlers that give FastAPI/Starlette's own errors
(unknown route, wrong method, anything unexpected) the same shape. `kind` labels the errors metric.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("coordinator")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str, kind: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.kind = kind  # metric label: invalid_request, auth, not_found, too_large, overloaded, draining, ...
        self.param = param
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
    return APIError(404, f"The model `{model}` does not exist; this server serves `{served}`",
                    "invalid_request_error", "not_found", "model", "model_not_found")


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than the limit of {limit} bytes", "invalid_request_error",
                    "too_large", code="request_too_large")


def unavailable(message: str, retry_after_s: float, kind: str) -> APIError:
    retry = str(max(1, round(retry_after_s)))
    return APIError(503, message, "server_error", kind, code="service_unavailable", headers={"Retry-After": retry})


def backend_failure(message: str) -> APIError:
    return APIError(502, f"The model backend failed: {message}", "server_error", "backend", code="backend_error")


def timeout(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within {seconds:g} s", "server_error", "timeout",
                    code="timeout")


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
        logger.exception("unexpected error serving %s", request.url.path)
        on_error("internal")
        return internal(f"Internal server error: {type(exc).__name__}").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
