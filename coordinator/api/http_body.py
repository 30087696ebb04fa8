"""The HTTP request body as JSON, under the server's limits: what every POST route of the coordinator reads.

Owns the checks made before a body is parsed or validated: `application/json` only (415 otherwise, a missing
Content-Type included), at most `server.max_body_bytes` (413, by the declared Content-Length and by the bytes
read), the whole body within `server.body_read_timeout_s` (408: a half-sent body must not hold the connection),
and valid JSON without NaN or Infinity constants (400).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import ClientDisconnect, Request

from coordinator import errors
from coordinator.client_text import NESTED_TOO_DEEPLY


async def read_json(request: Request, limit: int, timeout_s: float) -> Any:
    """The body as JSON: `application/json` (charset utf-8 or none) or 415, at most `limit` bytes or 413, all of it
    within `timeout_s` or 408 (a half-sent body must not hold the connection)."""
    check_content_type(request.headers.get("content-type"))
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        if not declared.isdigit():
            raise errors.invalid_request("Invalid Content-Length header")
        raise errors.too_large(limit)
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise errors.too_large(limit)
    except TimeoutError:
        raise errors.request_timeout(timeout_s) from None
    except ClientDisconnect:
        raise errors.invalid_request("The client disconnected while sending the request body") from None
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise errors.invalid_request(f"The request body is {NESTED_TOO_DEEPLY} to parse as JSON") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise errors.invalid_request(f"The request body is not valid JSON: {e}") from None


def check_content_type(value: str | None) -> None:
    """Strict: a missing Content-Type is refused too (curl -d and the OpenAI clients always send one)."""
    media, _, params = (value or "").partition(";")
    charset = [p.split("=", 1)[1].strip().strip('"').lower() for p in params.split(";") if "=" in p
               and p.split("=", 1)[0].strip().lower() == "charset"]
    if media.strip().lower() != "application/json" or any(c not in ("utf-8", "utf8") for c in charset):
        raise errors.unsupported_media_type(value)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")
