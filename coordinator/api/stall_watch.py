"""Stalled clients: a streamed response whose client has stopped taking its bytes is cut after
`server.stall_timeout_s`, so its request is aborted on every worker and its KV booking freed long before the
request's deadline (`server.request_timeout_s`).

Owns `StallPolicy` (the timeout, and what counts a stall: /metrics `pdserve_stalled_clients_total`) and
`StallWatch`, which an SSEResponse (coordinator.api.sse) runs beside its writes.

Output buffering per request is bounded by the ASGI server's flow control: uvicorn's `send` waits once the
connection's write buffer passes its high-water mark (64 KiB), so a client that stops reading blocks its response's
next write, and the response then pulls nothing more from the backend. What the coordinator holds for such a
client is that buffer, the kernel's socket buffers, and the output its worker produced until the stall was noticed
(at most about 1.25 x stall_timeout_s of decoding, never past max_tokens).

A stall is a write that has not returned for `timeout_s`: the response counts its writes (`writes`, odd while one
is under way: two integer increments per chunk), and the watch looks every quarter of the timeout; a write seen
pending at two looks at least a timeout apart, with no write completed in between, is a stall. Then it logs one
line (with the request's id), counts it, cancels the response (whose cleanup closes the backend stream: an abort
on every worker, the booking released) and drops the connection at once (`ABORT_CONNECTION`, which
coordinator.api.http_protocol puts in each request's scope): a graceful close would wait for a buffer the client
never drains. A client that reads slowly but steadily lets its writes return and is never cut.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from starlette.types import Scope

ABORT_CONNECTION = "pdserve.abort_connection"  # scope key: drops the request's connection now (transport.abort)
LOOKS_PER_TIMEOUT = 4
log = logging.getLogger("coordinator")


@dataclass(frozen=True)
class StallPolicy:
    timeout_s: float                 # server.stall_timeout_s
    on_stall: Callable[[], None]     # counts a stalled client (Metrics.stalled_clients.inc)


class StallWatch:
    """Watches one response's writes (`writes()`: odd while one is under way); on a stall, cancels `cancel` (the
    response's task group) and drops the connection named in `scope`."""

    def __init__(self, policy: StallPolicy, writes: Callable[[], int], scope: Scope,
                 cancel: anyio.CancelScope) -> None:
        self.policy = policy
        self._writes = writes
        self._scope = scope
        self._cancel = cancel
        self.stalled = False

    async def run(self) -> None:
        timeout = self.policy.timeout_s
        seen, since = self._writes(), anyio.current_time()
        while True:
            await anyio.sleep(timeout / LOOKS_PER_TIMEOUT)
            now, writes = anyio.current_time(), self._writes()
            if writes != seen or writes % 2 == 0:  # a write returned, or none is under way
                seen, since = writes, now
            elif now - since >= timeout:
                self._stall()
                return

    def _stall(self) -> None:
        self.stalled = True
        log.warning("the client has taken none of its stream for %g s (server.stall_timeout_s): its request is "
                    "aborted and its connection dropped", self.policy.timeout_s)
        self.policy.on_stall()
        self._cancel.cancel()
        abort = self._scope.get(ABORT_CONNECTION)
        if abort is not None:
            abort()
