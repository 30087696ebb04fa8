"""The UCX handshake: opening an endpoint to a peer's listener, and telling a slow peer from an absent one.
(A peer without a listener is reached by its worker address instead: kvtransfer.backends.ucx_worker_address.)

A connection is made in steps: a UCX endpoint to the peer's listener (UCX's own connection setup), ucxx's
peer-info exchange on it (a few bytes each way, answered by the listener's handler on the peer's event loop), then
our hello (see `kvtransfer.backends.ucx.UcxConnection.open`). On a loaded machine the peer's loop may answer late,
and the peer's listener gives up on its side of the exchange after ucxx's 5 s; either way the attempt fails
although the peer is alive. When nothing listens at the port (the peer is gone) the UCX endpoint itself fails at
once ("Endpoint is not connected"), but ucxx's `create_endpoint` keeps waiting for the exchange until its own
timeout, so the two looked alike (a timeout or a PeerLost after seconds, picked by which timer fired first).

`open_endpoint` builds the endpoint from ucxx's own pieces (pinned ucxx 0.52: `ucxx._lib.libucxx.UCXEndpoint`,
`exchange_peer_info`, `Endpoint`) so it can watch the endpoint while the exchange runs: a failed endpoint is
`HandshakeRefused` (a PeerLost, raised as soon as UCX reports it), an exchange still unanswered when the attempt's
time is up is `HandshakeTimedOut`, one that failed on a live endpoint (the peer closed it) a plain PeerLost.
`with_retries` runs attempts under a `HandshakePolicy` (kvtransfer.agent_config): a refused one fails at once;
one that timed out or broke (PeerLost / TransferTimeout, the hello's included) is tried again after a growing wait,
a bounded number of times and never past the caller's deadline (a dead peer's next attempt is refused, so it still
fails fast).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import ucxx
import ucxx._lib.libucxx as ucx_api
from ucxx._lib_async.endpoint import Endpoint
from ucxx._lib_async.exchange_peer_info import exchange_peer_info
from ucxx._lib_async.utils import hash64bits

from ..agent_config import HandshakePolicy
from ..errors import PeerLost, TransferTimeout

log = logging.getLogger(__name__)
T = TypeVar("T")

WATCH_S = 0.01  # how often the endpoint's state is looked at while the exchange runs
CLOSE_WAIT_NS = 10**8  # aborting a failed attempt's endpoint waits at most this long for UCX


class HandshakeRefused(PeerLost):
    """The peer's address refused the connection (nothing listens there, or the peer closed it at once)."""


class HandshakeTimedOut(TransferTimeout):
    """A handshake attempt got no answer in its time; the endpoint was alive (the peer may just be slow)."""


async def open_endpoint(address: str, port: int, peer: str, deadline: float) -> Any:
    """One attempt: an ucxx Endpoint to `peer`'s listener at address:port whose peer-info exchange finished before
    `deadline`; HandshakeRefused if UCX failed the endpoint first, HandshakeTimedOut if the time ran out, PeerLost if
    the exchange failed otherwise. A failed attempt's
    endpoint is aborted (the peer never sees it half-made)."""
    ctx = ucxx.core._get_ctx()
    ctx.continuous_ucx_progress()
    where = f"{peer!r} at {address}:{port}"
    try:
        ucx_ep = ucx_api.UCXEndpoint.create(ctx.worker, address, port, True)
    except ucxx.exceptions.UCXError as e:
        raise HandshakeRefused(f"cannot connect to {where}: {type(e).__name__}: {e}") from e
    if not ctx.progress_mode.startswith("thread"):
        ctx.worker.progress()
    tag = hash64bits("msg_tag", os.urandom(16), ucx_ep.handle)
    remaining = max(0.0, deadline - time.monotonic())
    exchange = asyncio.ensure_future(exchange_peer_info(endpoint=ucx_ep, msg_tag=tag, listener=False,
                                                        connect_timeout=remaining + 1.0))
    exchange.add_done_callback(lambda t: t.cancelled() or t.exception())  # always retrieved
    try:
        await watch(exchange, ucx_ep, deadline)
        if exchange.done() and exchange.exception() is None and ucx_ep.alive:
            info = exchange.result()
            return Endpoint(endpoint=ucx_ep, ctx=ctx, tags={"msg_send": info["msg_tag"], "msg_recv": tag})
        if not ucx_ep.alive:
            raise HandshakeRefused(f"cannot connect to {where}: refused ({endpoint_error(ucx_ep)}); "
                                   f"the peer is gone or nothing listens there")
        if exchange.done():  # the exchange failed on an endpoint UCX still calls alive: the peer closed it
            raise PeerLost(f"handshake with {where} failed: {exchange.exception()!r}")
        raise HandshakeTimedOut(f"handshake with {where}: no answer within the attempt's time")
    except BaseException:
        exchange.cancel()
        ucx_ep.close_blocking(period=CLOSE_WAIT_NS, max_attempts=1)
        raise


async def watch(task: asyncio.Future, ucx_ep: Any, deadline: float) -> None:
    """Wait until `task` is done, UCX failed the endpoint `ucx_ep` (a ucxx UCXEndpoint), or `deadline` passed."""
    while not task.done() and ucx_ep.alive and time.monotonic() < deadline:
        await asyncio.wait({task}, timeout=min(WATCH_S, max(0.0, deadline - time.monotonic())))


def endpoint_error(ucx_ep: Any) -> str:
    try:
        ucx_ep.raise_on_error()
    except ucxx.exceptions.UCXError as e:
        return f"{type(e).__name__}: {e}"
    return "endpoint closed"


async def with_retries(attempt: Callable[[float], Awaitable[T]], policy: HandshakePolicy, deadline: float,
                       what: str, record: Callable[[str], None]) -> T:
    """`attempt(attempt_deadline)` until it succeeds, under `policy` and before `deadline`. `record(outcome)` is
    told "retried" for each attempt tried again, then "connected", "refused" or "failed" (retries used up, or no
    time left for another: the last error is raised, saying how many attempts were made)."""
    waits = policy.backoffs(deadline)
    n = 0
    while True:
        n += 1
        try:
            result = await attempt(min(deadline, time.monotonic() + policy.attempt_s))
        except HandshakeRefused:
            record("refused")
            raise
        except (PeerLost, TransferTimeout) as e:
            wait = next(waits, None)
            if wait is None:
                record("failed")
                raise type(e)(f"{e} (gave up after {n} handshake attempt{'s' if n > 1 else ''})") from e
            record("retried")
            log.warning("%s: handshake attempt %d failed (%s), trying again in %.2f s", what, n, e, wait)
            await asyncio.sleep(wait)
            continue
        record("connected")
        return result
