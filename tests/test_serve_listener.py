"""The server's listening socket (coordinator.api.listener.bind_listener): connections uvicorn accepts from it have
Nagle's
algorithm off, so a stream's small writes (the response head, each token's chunk) go out at once instead of waiting
for the client's delayed ACK (up to ~40 ms on Linux)."""

import asyncio
import socket

import pytest
import uvicorn

from coordinator.api.http_server import uvicorn_config
from coordinator.api.listener import ListenError, bind_listener
from coordinator.config.settings import ServerSettings


async def _app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def test_accepted_connections_have_tcp_nodelay():
    async def run() -> list[int]:
        sock = bind_listener("127.0.0.1", 0)
        settings = ServerSettings(host="127.0.0.1", port=sock.getsockname()[1])
        server = uvicorn.Server(uvicorn_config(_app, settings, log_config=None, lifespan="off"))
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection(*sock.getsockname())
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            await writer.drain()
            assert (await reader.readline()).startswith(b"HTTP/1.1 200")
            flags = [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                     for c in server.server_state.connections]
            writer.close()
            return flags
        finally:
            server.should_exit = True
            await serving
            sock.close()

    flags = asyncio.run(run())
    assert flags and all(flags), f"TCP_NODELAY per accepted connection: {flags}"


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with pytest.raises(ListenError, match="cannot listen on 127.0.0.1"):
            bind_listener("127.0.0.1", taken.getsockname()[1])
