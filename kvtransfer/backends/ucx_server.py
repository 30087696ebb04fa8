"""The server side of the `ucx` backend: how peers reach an agent over ucxx, and the endpoints they opened to it.

`UcxServer` owns how peers reach us (a UCX listener, or our worker address: kvtransfer.backends.ucx_worker_address)
and the endpoints peers opened to us (`PeerEndpoint`), and hands each request to a `RequestHandler` (the agent's
kvtransfer.serve.Server). A peer's hello supersedes the connections the same agent opened to us before (it holds one
connection per peer: the older ones are stale attempts or broken). Every wait is bounded by a deadline, as on the
client side (kvtransfer.backends.ucx.bounded). Everything here runs on the owning agent's event-loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch
import ucxx

from .. import wire
from . import ucx_worker_address
from .ucx import as_ucx_buffer, bounded

log = logging.getLogger(__name__)


class PeerEndpoint:
    """The server side of a connection a peer opened to us: replies and data go back on it."""

    def __init__(self, ep: Any, seq: int) -> None:
        self.ep = ep
        self.seq = seq  # the order in which peers' connections reached us
        self.peer = "?"  # set by the hello
        self.meta: Any = None  # the peer's AgentMetadata, set by the hello
        self.broken: str | None = None
        self.timed_out = False

    def abort(self, reason: str) -> None:
        self.broken = self.broken or reason
        try:
            self.ep.abort()
        except Exception:  # noqa: BLE001
            pass

    async def reply(self, xid: int, msg: dict, deadline: float) -> None:
        await bounded(wire.send_msg(self.ep, msg, wire.response_tag(xid)), deadline, f"reply to {self.peer!r}", self)

    async def send_data(self, buf: torch.Tensor, xid: int, deadline: float) -> None:
        await bounded(self.ep.send(as_ucx_buffer(buf), tag=wire.data_tag(xid)), deadline,
                      f"data to {self.peer!r}", self)

    async def recv_data(self, buf: torch.Tensor, xid: int, deadline: float) -> None:
        await bounded(self.ep.recv(as_ucx_buffer(buf), tag=wire.data_tag(xid)), deadline,
                      f"data from {self.peer!r}", self)


class RequestHandler(Protocol):
    async def on_hello(self, peer: PeerEndpoint, msg: dict) -> dict: ...

    def on_notify(self, peer: PeerEndpoint, msg: dict) -> None: ...

    async def on_request(self, peer: PeerEndpoint, msg: dict) -> None: ...


class UcxServer:
    """How peers reach us (our listener, or our worker address) and the endpoints they opened; one task per peer
    reads its requests."""

    def __init__(self, handler: RequestHandler) -> None:
        self._handler = handler
        self._listener: Any = None
        self._acceptor: ucx_worker_address.Acceptor | None = None
        self._peers: set[PeerEndpoint] = set()
        self._tasks: set[asyncio.Task] = set()
        self._accepted = 0

    def start(self, port: int = 0) -> int:
        """Listen on `port` (0: one the kernel picks), on every interface; returns the port."""
        self._listener = ucxx.create_listener(self._accept, port=port)
        return int(self._listener.port)

    def start_by_worker_address(self) -> tuple[bytes, int]:
        """Accept connections made by our worker address (no listening socket); returns it and the accept tag."""
        self._acceptor = ucx_worker_address.Acceptor(lambda ep: self._spawn(self._accept(ep)))
        return self._acceptor.start()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, ep: Any) -> None:
        self._accepted += 1
        peer = PeerEndpoint(ep, self._accepted)
        self._peers.add(peer)
        buf = bytearray(wire.FRAME_BYTES)  # requests are read one at a time: one frame buffer per peer
        try:
            while peer.broken is None:
                try:
                    msg = await wire.recv_msg(ep, wire.REQUEST_TAG, buf)
                except (ucxx.exceptions.UCXError, asyncio.CancelledError):
                    peer.broken = "peer closed"
                    return
                except ValueError as e:  # not our protocol: drop the peer rather than guess
                    peer.abort(f"unreadable request: {e}")
                    return
                if msg.get("op") == "hello":
                    resp = await self._handler.on_hello(peer, msg)
                    await peer.reply(0, resp, time.monotonic() + 10.0)
                    if not resp.get("ok"):
                        return
                    self._supersede(peer)
                elif msg.get("op") == "notify":  # inline, not a task: one loop iteration less, and in order
                    try:
                        self._handler.on_notify(peer, msg)
                    except Exception:  # a listener's bug must not end this peer's requests
                        log.exception("notification from %r: its handler failed", peer.peer)
                else:
                    self._spawn(self._handler.on_request(peer, msg))
        finally:
            self._peers.discard(peer)

    def _supersede(self, peer: PeerEndpoint) -> None:
        """Abort the connections `peer`'s agent opened to us before this one (its stale handshake attempts, or
        one it gave up): a worker-address connection's server side learns of neither otherwise."""
        key = peer.meta.identity
        self.abort_peers(lambda p: p.seq < peer.seq and p.meta is not None and p.meta.identity == key,
                         "superseded by a newer connection of the same agent")

    def abort_peers(self, match: Callable[[PeerEndpoint], bool], reason: str) -> int:
        """Abort the endpoints peers opened to us that `match`; their requests in progress fail."""
        hit = [p for p in self._peers if match(p)]
        for p in hit:
            p.abort(reason)
        return len(hit)

    async def close(self) -> None:
        if self._acceptor is not None:
            await self._acceptor.close()
            self._acceptor = None
        for p in list(self._peers):
            p.abort("agent closing")
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=2.0)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
