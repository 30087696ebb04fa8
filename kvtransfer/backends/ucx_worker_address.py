"""UCX connections opened by a peer's worker address, with no listening socket: both sides of them.

A UCX connection listener (`ucxx.create_listener`) listens on every interface, as ucxx takes a port but no
address for it. An agent that peers reach by its worker address instead (`AgentConfig.ucx_connect`) has no such
socket: UCX reaches it over its data transports (shared memory, CUDA IPC, and TCP or RDMA on the devices
UCX_NET_DEVICES allows; the TCP transport listens on those devices' addresses only).

An endpoint made from a worker address carries messages one way and comes with no tags, so a connection is a pair
of endpoints and a pair of tags, set up by one message:
- the server (`Acceptor`) draws a random 64-bit *accept tag*, published with its worker address in its metadata,
  and keeps one receive posted on it (through an endpoint to its own worker, whose abort cancels the receive:
  ucxx cancels no receive posted on the worker itself, and several agents of one process share that worker);
- the client (`connect`) makes an endpoint from the server's worker address, draws the connection's two tags and
  sends a *connect request* on the accept tag: its own worker address and the tags;
- the server makes an endpoint back from the client's address and hands it, tagged, to the agent, which serves it
  as one a listener accepted (kvtransfer.backends.ucx_server.UcxServer). Then the client's hello goes as usual.

Telling a slow peer from an absent one: UCX cannot reach a dead process's worker, so `connect` fails at once
(HandshakeRefused); a live but stopped or busy peer leaves the hello unanswered (a timeout, tried again:
kvtransfer.backends.ucx_handshake.with_retries). A closed agent whose process lives on is not told from a slow one:
its connect requests go unanswered until the caller's deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

import ucxx
import ucxx._lib.libucxx as ucx_api
from ucxx._lib_async.endpoint import Endpoint

from .. import wire
from ..errors import PeerLost
from .ucx_handshake import CLOSE_WAIT_NS, HandshakeRefused, HandshakeTimedOut, endpoint_error, watch

log = logging.getLogger(__name__)


def _tag() -> int:
    return int.from_bytes(os.urandom(8), "little")


def _endpoint(ctx: Any, address: bytes) -> Any:
    """A raw ucxx endpoint to the worker at `address` (UCXError if UCX cannot reach it)."""
    ucx_ep = ucx_api.UCXEndpoint.create_from_worker_address(ctx.worker, ucx_api.UCXAddress.create_from_buffer(address),
                                                            True)
    if not ctx.progress_mode.startswith("thread"):
        ctx.worker.progress()
    return ucx_ep


def own_address() -> bytes:
    """This process's UCX worker address."""
    return ucxx.core._get_ctx().worker_address.tobytes()


async def connect(worker_address: bytes, accept_tag: int, peer: str, deadline: float) -> Any:
    """One attempt: an ucxx Endpoint to `peer`, whose connect request was sent before `deadline`;
    HandshakeRefused when UCX cannot reach its worker (its process is gone), HandshakeTimedOut when the request
    was not sent in time. A failed attempt's endpoint is aborted."""
    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress()
    where = f"{peer!r} by its UCX worker address"
    try:
        ucx_ep = _endpoint(ctx, worker_address)
    except ucxx.exceptions.UCXError as e:
        raise HandshakeRefused(f"cannot connect to {where}: {type(e).__name__}: {e}; the peer is gone") from e
    ours, theirs = _tag(), _tag()
    ep = Endpoint(endpoint=ucx_ep, ctx=ctx, tags={"msg_send": theirs, "msg_recv": ours})
    request, rest = wire.frame({"op": "connect", "worker_address": wire.b64(own_address()), "tags": [theirs, ours]})
    assert rest is None  # a worker address is a few hundred bytes
    send = asyncio.ensure_future(ep.send(request, tag=accept_tag, force_tag=True))
    send.add_done_callback(lambda t: t.cancelled() or t.exception())  # always retrieved
    try:
        await watch(send, ucx_ep, deadline)
        if send.done() and send.exception() is None and ucx_ep.alive:
            return ep
        if not ucx_ep.alive:
            raise HandshakeRefused(f"cannot connect to {where}: refused ({endpoint_error(ucx_ep)}); the peer is gone")
        if send.done():
            raise PeerLost(f"connect request to {where} failed: {send.exception()!r}")
        raise HandshakeTimedOut(f"connect request to {where}: not sent within the attempt's time")
    except BaseException:
        send.cancel()
        ep.abort(period=CLOSE_WAIT_NS, max_attempts=1)
        raise


class Acceptor:
    """The server side: the accept tag and the receive on it; each valid connect request becomes a tagged
    endpoint back to its client, passed to `on_endpoint` (on the agent's loop)."""

    def __init__(self, on_endpoint: Callable[[Any], None]) -> None:
        self._on_endpoint = on_endpoint
        self.tag = _tag()
        self.address = b""
        self._inbox: Any = None  # our endpoint to our own worker: the accept receive is posted on it
        self._task: asyncio.Task | None = None

    def start(self) -> tuple[bytes, int]:
        """Start accepting (on the running loop); returns (our worker address, the accept tag)."""
        ctx = ucxx.core._get_ctx()
        ctx.continuous_ucx_progress()
        self.address = own_address()
        self._inbox = Endpoint(endpoint=_endpoint(ctx, self.address), ctx=ctx,
                               tags={"msg_send": self.tag, "msg_recv": self.tag})
        self._task = asyncio.ensure_future(self._accept())
        return self.address, self.tag

    async def _accept(self) -> None:
        ctx = ucxx.core._get_ctx()
        buf = bytearray(wire.FRAME_BYTES)
        while self._inbox is not None:
            try:
                await self._inbox.recv(buf, tag=self.tag, force_tag=True)
            except (ucxx.exceptions.UCXError, asyncio.CancelledError):
                return  # closed
            try:
                nbytes = wire.body_length(buf)
                if not wire.inline(nbytes):
                    raise ValueError(f"a connect request of {nbytes} bytes")
                msg = wire.decode_frame(buf, nbytes)
                ours, theirs = (int(t) for t in msg["tags"])
                ucx_ep = _endpoint(ctx, wire.unb64(msg["worker_address"]))
            except (ValueError, KeyError, TypeError, ucxx.exceptions.UCXError) as e:
                log.warning("a connect request was dropped: %s: %s", type(e).__name__, e)
                continue
            self._on_endpoint(Endpoint(endpoint=ucx_ep, ctx=ctx, tags={"msg_send": theirs, "msg_recv": ours}))

    async def close(self) -> None:
        """Stop accepting: the receive is cancelled with our endpoint to ourselves."""
        if self._inbox is not None:
            self._inbox.abort(period=CLOSE_WAIT_NS, max_attempts=1)
            self._inbox = None
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=2.0)
            self._task.cancel()
            self._task = None
