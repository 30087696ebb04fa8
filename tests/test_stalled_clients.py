"""Stalled clients on the real server (`pdserve serve`, local Ray, 1 prefill + 1 decode, the embedded `tiny` model):
a client that stops reading its stream is cut after `server.stall_timeout_s` (coordinator.api.stall_watch): its
request is aborted on the workers before its end, its KV booking freed, one stall counted in
`pdserve_stalled_clients_total` and its connection dropped, while a client that reads is served meanwhile; also a
plain client that never reads, whose default buffers (on loopback) could take its whole stream."""

import asyncio
import json
import socket
from functools import partial
from urllib.parse import urlparse

import httpx
import pytest

from tests.server_process import (
    HALF_CPU,
    assert_nothing_booked,
    complete,
    metric_values,
    poll,
    running_server,
)

pytestmark = pytest.mark.timeout(400)
STALL_S = 2.0
MAX_TOKENS = 1900  # of tiny's 2048 positions: a stream far longer than the socket buffers a stalled client fills
DEADLINE_S = 180.0  # generous bound for polled states on a loaded 2-core machine (never a measured duration)
_poll = partial(poll, deadline_s=DEADLINE_S)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": HALF_CPU, "transfer": {"backends": ["ucx"]},
              "server": {"admin_api": True, "stall_timeout_s": STALL_S}}
    with running_server(tmp_path_factory.mktemp("stalled_clients"), config) as server:
        yield server


def _open_stalled_stream(url: str, body: dict) -> socket.socket:
    """A streamed completion on a raw socket with tiny buffers, read up to its response head only: from
    then on the client takes nothing, as one that stopped reading (its socket stays open)."""
    address = urlparse(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # before connect: the window it advertises, and a small segment size, which keeps the server's send buffer
    # small (Linux sizes it by segments: at loopback's 64 KiB segments it grows to megabytes, more than a stream)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.settimeout(60)
    sock.connect((address.hostname, address.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    head = sock.recv(64)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def _sampled_tokens(url: str) -> float:
    """Tokens every worker's engine has sampled since it started (the engines' own counters)."""
    return sum(metric_values(url, "pdserve_worker_engine_sampled_tokens_total").values())


def test_a_client_that_stops_reading_is_aborted_and_its_blocks_freed(server):
    url = server.url
    before = _sampled_tokens(url)
    # with logprobs, each chunk is larger: the buffers fill after fewer tokens, most of the stream still ahead
    stalled = _open_stalled_stream(url, {"model": "tiny", "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
                                         "ignore_eos": True, "stream": True, "temperature": 0, "logprobs": 20})
    try:
        async def normal() -> dict:  # another client, served while the stalled one holds its stream
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                return await complete(client, url, {"model": "tiny", "prompt": "The sea", "max_tokens": 48,
                                                    "ignore_eos": True, "stream": True, "temperature": 0})
        served = asyncio.run(normal())
        assert (served["completion_tokens"], served["finish_reason"]) == (48, "length")

        stalls = _poll(lambda: metric_values(url, "pdserve_stalled_clients_total").get(None, 0) >= 1)
        assert stalls, "the stalled client was never cut"
        assert metric_values(url, "pdserve_stalled_clients_total")[None] == 1
        assert metric_values(url, "pdserve_requests_total")['{outcome="aborted"}'] == 1
        integrity = assert_nothing_booked(url)  # no booking, no engine block in use or pinned, integrity ok
        assert integrity["ok"], integrity
        # aborted on the decode worker before its end: the engines sampled fewer tokens than the stream asked for
        # (on the 2-core CI machine about 700 of 1948 by the cut: the writes block after ~150 tokens, then the cut
        # comes 2-2.5 s later; an engine decoding over ~700 tokens/s would end the stream first)
        assert _sampled_tokens(url) - before < MAX_TOKENS + 48

        # the server dropped the connection: reading what is left ends (EOF or a reset), it does not hang
        stalled.settimeout(1)

        def ended() -> bool:
            try:
                return stalled.recv(1 << 16) == b""
            except ConnectionResetError:
                return True
            except TimeoutError:
                return False
        assert poll(ended, 60), "the stalled client's connection is still open"
    finally:
        stalled.close()


def test_a_client_that_never_reads_with_default_buffers_stops_its_generation(server):
    """A plain client (the kernel's default buffers, which on loopback can take a whole stream) sends a long
    streamed request and never reads a byte, not even the response head: once the bytes it leaves unread stay
    unacknowledged for `server.stall_timeout_s`, its request is aborted on the workers well before its end."""
    url = server.url
    before = _sampled_tokens(url)
    stalls = metric_values(url, "pdserve_stalled_clients_total").get(None, 0)
    aborted = metric_values(url, "pdserve_requests_total").get('{outcome="aborted"}', 0)
    address = urlparse(url)
    body = json.dumps({"model": "tiny", "prompt": "A long road", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "stream": True, "temperature": 0, "logprobs": 20}).encode()
    with socket.create_connection((address.hostname, address.port), timeout=60) as never_reads:
        never_reads.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        cut = _poll(lambda: metric_values(url, "pdserve_stalled_clients_total").get(None, 0) > stalls)
        assert cut, "the client that never reads was never cut"
        assert metric_values(url, "pdserve_requests_total")['{outcome="aborted"}'] == aborted + 1
        integrity = assert_nothing_booked(url)
        assert integrity["ok"], integrity
        # the generation stopped before its end (the client's default receive buffer holds a few hundred of
        # these chunks): the engines sampled fewer tokens than the stream asked for
        assert _sampled_tokens(url) - before < MAX_TOKENS
