"""The request-head limit (`server.max_request_header_bytes`, coordinator.api.http_protocol) on the real app under the
real uvicorn configuration and a real engine: a head of exactly the limit is served and one byte more is a 431 with
the connection closed, wherever the reads split it; a head over the limit pipelined behind a request is answered only
after that request's response; a request line alone over it is a 414. The flood on the whole server:
tests/test_hostile_limits.py."""

import json
import socket

import pytest

from coordinator.config.settings import ServerSettings
from tests.test_http_hardening import start

pytestmark = pytest.mark.timeout(90)
LIMIT = 4096
GET = b"GET /health HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module")
def server(checkpoints):
    with start(checkpoints, ServerSettings(max_request_header_bytes=LIMIT)) as srv:
        yield srv


def _exchange(port: int, data: bytes, piece: int) -> bytes:
    """Send `data` in pieces of `piece` bytes, then read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for i in range(0, len(data), piece):
            s.sendall(data[i:i + piece])
        received = []
        while chunk := s.recv(65536):
            received.append(chunk)
    return b"".join(received)


def _head_of(size: int, last: bytes = b"Connection: close\r\n") -> bytes:
    """A GET head of exactly `size` bytes (an X-Pad header filling the room)."""
    fixed = len(GET) + len(b"X-Pad: \r\n") + len(last) + 2
    return GET + b"X-Pad: " + b"p" * (size - fixed) + b"\r\n" + last + b"\r\n"


@pytest.mark.parametrize("piece", [1 << 20, 1000, 7])
def test_a_head_of_the_limit_is_served_and_one_byte_more_is_a_431(server, piece):
    assert len(_head_of(LIMIT)) == LIMIT
    assert _exchange(server.port, _head_of(LIMIT), piece).startswith(b"HTTP/1.1 200 ")
    reply = _exchange(server.port, _head_of(LIMIT + 1), piece)
    status, _, rest = reply.partition(b"\r\n")
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
    assert b"connection: close" in rest.lower()
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_header_fields_too_large"


def test_a_head_over_the_limit_behind_a_pipelined_request_is_answered_after_it(server):
    reply = _exchange(server.port, GET + b"\r\n" + _head_of(LIMIT * 3, b""), 1 << 20)
    first, _, rest = reply.partition(b"HTTP/1.1 431 ")
    assert first.startswith(b"HTTP/1.1 200 ") and first.count(b"HTTP/1.1 ") == 1 and rest


def test_a_request_line_over_the_limit_is_a_414(server):
    reply = _exchange(server.port, b"GET /health?q=" + b"q" * LIMIT + b" HTTP/1.1\r\nHost: x\r\n\r\n", 1 << 20)
    assert reply.startswith(b"HTTP/1.1 414 URI Too Long")
    assert json.loads(reply.partition(b"\r\n\r\n")[2])["error"]["code"] == "uri_too_long"
