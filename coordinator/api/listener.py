"""The server's listening socket, bound by `pdserve serve` before anything else starts (a port in use fails in a
second). Its own module, importing nothing but the standard library: the supervisor binds it before it starts Ray,
and importing the HTTP server (FastAPI, uvicorn: ~0.3 s on the CPU machine, several times that on a GPU host) there
would delay every worker's start by as much."""

from __future__ import annotations

import socket


class ListenError(OSError):
    pass


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (uvicorn serves on it); ListenError names the address and the cause.
    Its protocol is named (IPPROTO_TCP): asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose
    proto says TCP, and a socket made with proto 0 passes that 0 to every connection it accepts. With Nagle on, a
    stream's small writes (the response head, then each token's chunk) wait for the client's delayed ACK: up to
    ~40 ms added to a first token or an inter-token gap, now and then."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: rebinding over TIME_WAIT is fine
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port} (server.host/server.port): {e.strerror}") from e
    sock.listen(2048)
    return sock
