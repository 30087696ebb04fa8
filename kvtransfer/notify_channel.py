"""Notifications over a plain TCP stream, beside the UCX data path: `NotifyListener` (ours) and `NotifySender`
(one per remote we notify).

A notification is a few dozen bytes that a peer waits on (a decode worker joins a pushed request on one), so its
latency is the point: a ucxx message completes through ucxx's progress and notifier threads on both sides (~340 us
one way between two processes on the 2-core machine), an asyncio TCP stream in ~20 us (benchmarks/notify_latency.py,
a retired experiment: docs/benchmark-log.md, commit e928424).
Order and meaning are the UCX path's: one stream per (sender, receiver) keeps a sender's notifications in order, and
the sender sends only after the transfers it speaks of have ended (KVAgent.notify_after), so data it names is in place.
A notification attached to a write (`write(..., notify=)`) is sent the same way once the write's chunks have
been confirmed. A peer whose metadata names no listener gets its notifications over UCX as before.

Wire: the sender's agent name once (a frame), then one frame per notification: a 4-byte little-endian length and the
bytes (at most wire.MAX_NOTIFY_BYTES; a longer announced frame ends the stream: not our protocol). Both ends run on
their agent's loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable

from . import wire
from .errors import PeerLost

log = logging.getLogger(__name__)

_LEN = 4


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(_LEN, "little") + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    n = int.from_bytes(await reader.readexactly(_LEN), "little")
    if n > wire.MAX_NOTIFY_BYTES:
        raise ValueError(f"a notification frame announces {n} bytes, over {wire.MAX_NOTIFY_BYTES}")
    return await reader.readexactly(n)


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a notification is one small write: send it now


class NotifyListener:
    """Accepts peers' notification streams; each notification goes to `deliver(sender, msg)` (the inbox)."""

    def __init__(self, deliver: Callable[[str, bytes], None]) -> None:
        self._deliver = deliver
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str) -> int:
        """Listen on `host` (an ephemeral port), or on every interface where `host` is not one of this machine's (an
        advertised address behind a NAT; the UCX listener takes every interface too); the port."""
        try:
            self._server = await asyncio.start_server(self._serve, host, 0)
        except OSError:
            self._server = await asyncio.start_server(self._serve, "0.0.0.0", 0)  # one socket: one port
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        sender = "?"
        try:
            sender = (await _read_frame(reader)).decode()
            while True:
                msg = await _read_frame(reader)
                try:
                    self._deliver(sender, msg)
                except Exception:  # a listener's bug must not end this peer's stream
                    log.exception("notification from %r: its handler failed", sender)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the peer closed or went away
        except (ValueError, UnicodeDecodeError) as e:
            log.warning("notification stream from %r dropped: %s", sender, e)
        finally:
            self._writers.discard(writer)
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        if self._server is not None:
            await self._server.wait_closed()


class NotifySender:
    """Our stream to one remote's NotifyListener, opened on first use and again after it broke."""

    def __init__(self, name: str, address: str, port: int, peer: str) -> None:
        self._hello = _frame(name.encode())
        self._address, self._port, self._peer = address, port, peer
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()

    async def send(self, msg: bytes, deadline: float) -> None:
        """Send one notification (PeerLost if the stream cannot be opened or written before `deadline`)."""
        async with self._lock:
            try:
                if self._writer is None or self._writer.is_closing():
                    _, writer = await asyncio.wait_for(asyncio.open_connection(self._address, self._port),
                                                       max(0.0, deadline - time.monotonic()))
                    _no_delay(writer)
                    writer.write(self._hello)
                    self._writer = writer
                self._writer.write(_frame(msg))
                await asyncio.wait_for(self._writer.drain(), max(0.0, deadline - time.monotonic()))
            except (OSError, asyncio.TimeoutError) as e:
                self.close()
                raise PeerLost(f"notification to {self._peer!r} at {self._address}:{self._port} failed: "
                               f"{type(e).__name__}: {e}") from e

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
