"""The `ucx` backend: connections between agents over ucxx (UCX: shared memory, TCP, RDMA, CUDA IPC).

ucxx 0.52's Python API exposes no one-sided RMA (no memory handles / remote keys), so a read or write is a
request/response exchange over tagged messages (see `kvtransfer.wire`), one large message per chunk.
Everything here runs on the owning agent's event-loop thread.

`UcxConnection` is the client side of one agent -> agent connection; the server side (`UcxServer`, how peers reach
us) is kvtransfer.backends.ucx_server. Both bound their waits with `bounded`.
Every wait is bounded by a deadline: when one passes, the connection is aborted (which cancels the posted
UCX requests, so no late message lands in a reused buffer) and TransferTimeout is raised. A wait that is
cancelled (its peer was removed) aborts the connection the same way before it lets the cancellation through.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable
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
