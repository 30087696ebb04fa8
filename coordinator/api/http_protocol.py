"""The HTTP/1.1 connection protocol pdserve serves with: uvicorn's httptools protocol plus a request-head timeout
and a request-head size limit.

uvicorn's httptools protocol has no limit on a request head's size: httptools buffers a header line however long
it is, so a client without any key could make the coordinator hold gigabytes (four connections sending 250 MB of
header lines, issue 46). HeadTimeoutProtocol counts the bytes of each request head (request line and headers) as
they arrive, before the parser sees them, and feeds the parser at most `max_head_bytes` of one head: a head that
does not end within them is answered 431 (414 while the request line has not ended) and the connection closed,
so a connection holds at most that much of a head. The count starts at a connection's start and again after each
head; the bytes of a kept-alive connection's next head that arrive in the same read as the previous request's end
are fed whole (one read, at most 256 KiB, as asyncio reads).

uvicorn has no timeout for a request head, so a connection that sends half a head, or nothing, would stay open
forever. HeadTimeoutProtocol gives a connection `header_timeout_s` from its start, and from the first byte of each
later request, to complete the head; otherwise it answers 408 and closes (never in the middle of a response still
being written: the 408 then waits for the response's end). A request target (path and query) over MAX_URL_BYTES
gets 414 URI Too Long and the connection closed (httptools cannot parse one over 64 KiB at all, which read as a
malformed request). Idle kept-alive connections are uvicorn's
`timeout_keep_alive`. Each request's scope also gets `ABORT_CONNECTION` (coordinator.api.stall_watch): the
connection's `transport.abort`, which drops a stalled client's connection without waiting for its buffer to drain,
and `CLIENT_PROGRESS`: how far the client has taken its bytes (coordinator.api.client_progress, read once per
connection).
httptools rather than h11: every streamed token is one HTTP chunk, and h11's state machine
per chunk cost ~15% of the coordinator's CPU per token (benchmarks/coordinator_overhead.py, docs/benchmark-log.md).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from coordinator.api.client_progress import client_progress
from coordinator.api.stall_watch import ABORT_CONNECTION, CLIENT_PROGRESS
from coordinator.errors import APIError

REQUEST_LINE_REST = 32  # a request line's bytes besides its URL: the method, two spaces, at most "HTTP/1.1\r\n"
MAX_URL_BYTES = 16384  # of a request target: every pdserve route is a short path; nginx allows 8 KiB, Node 16 KiB


class HeadTimeoutProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0  # set per server by a subclass (coordinator.api.http_server.uvicorn_config)
    max_head_bytes: int = 64 << 10  # likewise (server.max_request_header_bytes)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_pending = True  # a request head is awaited: from the start, and from each later first byte
        self._head_bytes = 0  # bytes of the pending head fed to the parser so far
        self._head_too_large = False  # a head over the limit: refused (after the responses before it), then dropped
        self._url_too_long = False
        self._client_progress = client_progress(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        """Feed the parser; of a pending head, no more than max_head_bytes in all (what follows a refused head is
        read and dropped)."""
        if self._head_too_large:
            return
        if not self._head_pending:
            super().data_received(data)
            return
        room = self.max_head_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        self._head_bytes = self.max_head_bytes
        super().data_received(data[:room])
        if self.transport.is_closing() or self._head_too_large:  # answered already (a URL over MAX_URL_BYTES)
            return
        if not self._head_pending:  # the head ended within the limit: the rest is its body or the next request
            self.data_received(data[room:])
            return
        self._head_too_large = True
        self.transport.pause_reading()  # until the refusal is written: then read only to be dropped
        if self.cycle is None or self.cycle.response_complete:
            self._refuse_head()

    def on_response_complete(self) -> None:
        if self._head_too_large and not self.transport.is_closing() and not self.pipeline:  # the head over the
            self._refuse_head()  # limit waited for the responses to the requests pipelined before it
        super().on_response_complete()

    def _refuse_head(self) -> None:
        self._cancel_head_timer()
        limit = f"{self.max_head_bytes} bytes (server.max_request_header_bytes)"
        url = getattr(self, "url", b"")  # what the parser has passed of the request line's URL (in fragments)
        if not self.headers and len(url) + REQUEST_LINE_REST >= self._head_bytes:  # still in the request line
            self._close_with(414, "URI Too Long", APIError(
                414, f"The request line is longer than {limit}", "invalid_request_error", "uri_too_long",
                code="uri_too_long"))
            return
        self._close_with(431, "Request Header Fields Too Large", APIError(
            431, f"The request head (request line and headers) is larger than {limit}", "invalid_request_error",
            "request_header_fields_too_large", code="request_header_fields_too_large"))

    def eof_received(self) -> bool | None:
        if self._head_too_large:
            self.transport.close()
        return super().eof_received()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_pending = True
        if self._head_timer is None:  # the first bytes of a new request on a kept-alive connection
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > MAX_URL_BYTES:
            self._url_too_long = True
            raise ValueError("request target too long")  # stops the parser: uvicorn calls send_400_response

    def on_headers_complete(self) -> None:
        self._head_pending = False
        self._head_bytes = 0  # the next head is counted from its own first byte
        self._cancel_head_timer()
        self.scope[ABORT_CONNECTION] = self.transport.abort  # type: ignore[typeddict-unknown-key]
        self.scope[CLIENT_PROGRESS] = self._client_progress  # type: ignore[typeddict-unknown-key]
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request httptools cannot parse (a malformed request line or header, such as a control character in a
        header value): OpenAI's error JSON, where uvicorn answers plain text."""
        self._cancel_head_timer()
        if self._url_too_long:  # refused mid-head like one over the size limit: the rest of it is read and dropped
            self._head_too_large = True
            self._close_with(414, "URI Too Long", APIError(
                414, f"The request's URL is longer than {MAX_URL_BYTES} bytes", "invalid_request_error",
                "invalid_request", code="uri_too_long"))
            return
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
        """Answer and close. After a refused head the close lingers (as nginx's lingering_close does): a client
        still sending its head would otherwise get a reset before it reads the answer. The answer is followed by a
        FIN, what still arrives is read and dropped, and the connection is closed when the client closes its side or
        after header_timeout_s."""
        body = json.dumps(error.body()).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, reason.encode(), len(body), body))
        if self._head_too_large and self.transport.can_write_eof():
            self.transport.write_eof()
            self.transport.resume_reading()
            self.loop.call_later(self.header_timeout_s, self.transport.close)
        else:
            self.transport.close()
