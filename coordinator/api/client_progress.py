"""How far a connection's client has taken the bytes written to it: what `StallWatch` (coordinator.api.stall_watch)
reads to tell a client that stopped reading from one that reads slowly.

A write that returns proves little: the kernel's send buffer grows with the connection (on loopback, to megabytes),
so a stream of short chunks can be written whole to a client that never reads. What the client's side takes shows
in TCP's acknowledgements instead: its kernel acknowledges bytes while its receive buffer has room and, once a
client that does not read has filled it (its window closed), acknowledges none. `client_progress(transport)` gives
a function returning `(pending, taken)`: bytes written but not yet acknowledged by the client (the transport's own
buffer plus the kernel's send queue, SIOCOUTQ) and the bytes it has acknowledged so far (TCP_INFO's
`tcpi_bytes_acked`, Linux 4.1+). It returns None where those are not readable (not Linux, not TCP), and the watch
then falls back to blocked writes. A closed socket reads as nothing pending.
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
from collections.abc import Callable

TCPI_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info
TCP_INFO_LEN = TCPI_BYTES_ACKED + 8

Progress = Callable[[], tuple[int, int]]  # () -> (bytes pending for the client, bytes it has acknowledged)


def client_progress(transport: asyncio.Transport) -> Progress | None:
    """`(pending, taken)` of the transport's TCP connection, or None where the platform cannot tell."""
    sock = transport.get_extra_info("socket")
    if (sock is None or not hasattr(socket, "TCP_INFO") or sock.family not in (socket.AF_INET, socket.AF_INET6)
            or sock.type != socket.SOCK_STREAM or _read(sock) is None):
        return None

    def progress() -> tuple[int, int]:
        if transport.is_closing():
            return 0, 0
        read = _read(sock)
        if read is None:
            return 0, 0
        outq, taken = read
        return transport.get_write_buffer_size() + outq, taken
    return progress


def _read(sock: socket.socket) -> tuple[int, int] | None:
    """(kernel send queue, bytes acknowledged) of a TCP socket; None if either cannot be read."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
        outq = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return None
    if len(info) < TCP_INFO_LEN:
        return None
    return struct.unpack("i", outq)[0], struct.unpack_from("Q", info, TCPI_BYTES_ACKED)[0]
