"""The HTTP/1.1 connection protocol pdserve serves with: uvicorn's httptools protocol plus a request-head timeout.

uvicorn has no timeout for a request head, so a connection that sends half a head, or nothing, would stay open
forever. HeadTimeoutProtocol gives a connection `header_timeout_s` from its start, and from the first byte of each
later request, to complete the head; otherwise it answers 408 and closes (never in the middle of a response still
being written: the 408 then waits for the response's end). Idle kept-alive connections are uvicorn's
`timeout_keep_alive`. Each request's scope also gets `ABORT_CONNECTION` (coordinator.api.stall_watch): the
connection's `transport.abort`, which drops a stalled client's connection without waiting for its buffer to drain.
httptools rather than h11: every streamed token is one HTTP chunk, and h11's state machine
per chunk cost ~15% of the coordinator's CPU per token (benchmarks/coordinator_overhead.py, docs/benchmark-log.md).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from coordinator.api.stall_watch import ABORT_CONNECTION
from coordinator.errors import APIError


class HeadTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0  # set per server by a subclass (coordinator.api.http_server.uvicorn_config)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_pending = True  # a request head is awaited: from the start, and from each later first byte
        self._arm_head_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_pending = True
        if self._head_timer is None:  # the first bytes of a new request on a kept-alive connection
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._head_pending = False
        self._cancel_head_timer()
        self.scope[ABORT_CONNECTION] = self.transport.abort  # type: ignore[typeddict-unknown-key]
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse (a malformed request line or header, such as a control character in a
        header value): OpenAI's error JSON, where uvicorn answers plain text."""
        self._cancel_head_timer()
        self._close_with(400, "Bad Request", APIError(
            400, "Invalid HTTP request: a malformed request line or header (RFC 9110 forbids control characters "
            "in header values)", "invalid_request_error", "invalid_request", code="invalid_http_request"))

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._head_pending:
            return
        if self.cycle is not None and not self.cycle.response_complete:  # a pipelined head stalled behind a
            self._arm_head_timer()                                      # response: answer once that has ended
            return
        self._close_with(408, "Request Timeout", APIError(
            408, f"The request head was not received within {self.header_timeout_s:g} s", "invalid_request_error",
            "request_timeout", code="request_timeout"))

    def _close_with(self, status: int, reason: str, error: APIError) -> None:
        body = json.dumps(error.body()).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, reason.encode(), len(body), body))
        self.transport.close()
