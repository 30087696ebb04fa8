"""The `ucx` backend: connections between agents over ucxx (UCX: shared memory, TCP, RDMA, CUDA IPC).

ucxx 0.52's Python API exposes no one-sided RMA (no memory handles / remote keys), so a read or write is a
request/response exchange over tagged messages (see `kvtransfer.wire`), one large message per chunk.
Everything here runs on the owning agent's event-loop thread.

`UcxConnection` is the client side of one agent -> agent connection; `UcxServer` owns how peers reach us (a UCX
listener, or our worker address: kvtransfer.backends.ucx_worker_address) and the endpoints peers opened to us, and
hands each request to a `RequestHandler` (the agent). A peer's hello supersedes the connections the same agent
opened to us before (it holds one connection per peer: the older ones are stale attempts or broken).
Every wait is bounded by a deadline: when one passes, the connection is aborted (which cancels the posted
UCX requests, so no late message lands in a reused buffer) and TransferTimeout is raised. A wait that is
cancelled (its peer was removed) aborts the connection the same way before it lets the cancellation through.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import torch
import ucxx

from .. import wire
from ..errors import PeerLost, TransferTimeout
from ..metadata import AgentMetadata
from ..step_times import StepTimes, maybe_step
from . import ucx_worker_address
from .ucx_handshake import open_endpoint

log = logging.getLogger(__name__)


def use_python_futures() -> None:
    """Opt this process into ucxx's Python-future request completion, before its first ucxx call.

    ucxx's default request wait busy-polls with asyncio.sleep(0), so an agent that always has a receive pending
    (every server) burns a core while idle (0.45 CPU-s/s measured, 0.01 with futures). Futures are completed by
    ucxx's notifier thread for a single event loop, so only a process with one agent (a pool worker) may use
    them; several agents in one process (tests, benches) keep the default.
    """
    os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")


def ucx_context() -> Any:
    """This process's ucxx application context, created by the first call (UCX's context and worker with every
    transport UCX finds, CUDA's included on a GPU host; ucxx's notifier and progress threads)."""
    return ucxx.core._get_ctx()


class BufferMayBeInUse(TransferTimeout):
    """A timeout after which a cancelled receive could not be confirmed finished: quarantine its buffer."""


def as_ucx_buffer(t: torch.Tensor) -> Any:
    """[n] u8 contiguous tensor -> an object ucxx can send/receive without a copy."""
    return t if t.is_cuda else t.numpy()


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


class _Link(Protocol):
    broken: str | None
    timed_out: bool

    def abort(self, reason: str) -> None: ...


async def bounded(aw: Awaitable[Any], deadline: float, what: str, link: _Link) -> Any:
    """Await `aw` until `deadline`; map UCX failures to PeerLost (or TransferTimeout when the connection
    was aborted because an operation on it timed out); on timeout abort the link, give the cancelled
    operation a moment to finish, and raise TransferTimeout (BufferMayBeInUse if it did not finish)."""
    task = asyncio.ensure_future(aw)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # always retrieved
    try:
        done, _ = await asyncio.wait({task}, timeout=_remaining(deadline))
    except asyncio.CancelledError:  # the transfer is being dropped: the posted operation must end first
        link.abort(f"{what}: cancelled")
        done, _ = await asyncio.wait({task}, timeout=2.0)
        if not done:
            task.cancel()
            raise BufferMayBeInUse(f"{what}: cancelled while the operation could not be stopped") from None
        raise
    if not done:
        link.timed_out = True
        link.abort(f"{what}: timed out")
        done, _ = await asyncio.wait({task}, timeout=2.0)
        if task.done() and not task.cancelled():
            task.exception()  # consumed: the timeout is the error we report
        if not done:
            task.cancel()
            raise BufferMayBeInUse(f"{what}: no progress before the deadline")
        raise TransferTimeout(f"{what}: no progress before the deadline")
    try:
        return task.result()
    except (ucxx.exceptions.UCXError, asyncio.CancelledError) as e:
        if link.timed_out:
            raise TransferTimeout(f"{what}: connection aborted after a timeout ({link.broken})") from e
        link.broken = link.broken or f"{what}: {type(e).__name__}: {e}"  # never reuse a failed endpoint
        raise PeerLost(f"{what}: connection failed ({type(e).__name__}: {e})") from e


class UcxConnection:
    """Our endpoint to one remote agent's listener (we are the client: we send requests on it)."""

    def __init__(self, ep: Any, peer: str) -> None:
        self.ep = ep
        self.peer = peer
        self.broken: str | None = None
        self.timed_out = False
        self._send_lock = asyncio.Lock()  # a long request is two messages: never interleave two requests

    @classmethod
    async def open(cls, meta: AgentMetadata, hello: dict, deadline: float,
                   steps: StepTimes | None = None) -> UcxConnection:
        """One handshake attempt (endpoint, peer-info exchange or connect request, our hello) to the agent `meta`
        describes, that must finish before `deadline`: HandshakeRefused when nothing listens or its process is
        gone, HandshakeTimedOut / TransferTimeout when the peer did not answer in time, PeerLost when it closed
        the connection, the peer's own error when it refused the hello. `steps`: the endpoint's and the hello's
        times go there (None: not timed)."""
        with maybe_step(steps, "ucx_endpoint"):
            if meta.worker_address is not None and meta.accept_tag is not None:
                ep = await ucx_worker_address.connect(meta.worker_address, meta.accept_tag, meta.name, deadline)
            else:
                ep = await open_endpoint(meta.address, meta.port, meta.name, deadline)
        conn = cls(ep, meta.name)
        try:
            with maybe_step(steps, "ucx_hello"):  # its round trip: the peer makes its endpoint back, checks ours
                await conn.request(hello, 0, deadline)
        except BaseException:
            conn.abort("hello refused or failed")  # never keep an endpoint nobody will use
            raise
        return conn

    def abort(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
        try:
            self.ep.abort()
        except Exception:  # noqa: BLE001 - already closed/failed endpoints may raise; aborting is best effort
            pass

    def _check(self) -> None:
        if self.broken is not None:
            raise PeerLost(f"connection to {self.peer!r} is broken: {self.broken}")

    async def send_request(self, msg: dict, deadline: float) -> None:
        self._check()
        async with self._send_lock:
            await bounded(wire.send_msg(self.ep, msg, wire.REQUEST_TAG), deadline, f"request to {self.peer!r}", self)

    async def response(self, xid: int, deadline: float) -> dict:
        """The next response for operation `xid`; raises the error the server reported."""
        self._check()
        resp = await bounded(wire.recv_msg(self.ep, wire.response_tag(xid)), deadline,
                             f"response from {self.peer!r}", self)
        if not resp.get("ok"):
            from ..errors import error_from_wire

            raise error_from_wire(resp.get("kind", ""), f"{self.peer!r}: {resp.get('error')}")
        return resp

    async def request(self, msg: dict, xid: int, deadline: float) -> dict:
        await self.send_request(msg, deadline)
        return await self.response(xid, deadline)

    async def send_data(self, buf: torch.Tensor, xid: int, deadline: float) -> None:
        self._check()
        await bounded(self.ep.send(as_ucx_buffer(buf), tag=wire.data_tag(xid)), deadline,
                      f"data to {self.peer!r}", self)

    async def recv_data(self, buf: torch.Tensor, xid: int, deadline: float) -> None:
        self._check()
        await bounded(self.ep.recv(as_ucx_buffer(buf), tag=wire.data_tag(xid)), deadline,
                      f"data from {self.peer!r}", self)

    async def close(self) -> None:
        if self.broken is None:
            self.broken = "closed"
            try:
                await asyncio.wait_for(self.ep.close(), 2.0)
            except Exception:  # noqa: BLE001 - a dead peer cannot be closed cleanly
                self.ep.abort()


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
