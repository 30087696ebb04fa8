"""Stalled clients: a streamed response whose client has stopped taking its bytes is cut after
`server.stall_timeout_s`, so its request is aborted on every worker (its generation stops) and its KV booking
freed long before the request's deadline (`server.request_timeout_s`) or the generation's end.

Owns `StallPolicy` (the timeout, and what counts a stall: /metrics `pdserve_stalled_clients_total`) and
`StallWatch`, which an SSEResponse (coordinator.api.sse) runs beside its writes.

What a client has taken is read from its TCP connection where the platform tells (Linux:
coordinator.api.client_progress, which coordinator.api.http_protocol puts in each request's scope as
`CLIENT_PROGRESS`): bytes written but not acknowledged by the client, and the bytes it has acknowledged. A stall
is bytes pending for the client, seen at two looks at least a timeout apart (the watch looks every quarter of it),
with none acknowledged in between. A client that does not read fills its receive buffer (about 100 KiB with
Linux's defaults), then acknowledges nothing: its stream is cut `stall_timeout_s` later, however large the
server's send buffer has grown (on loopback it takes megabytes, a whole stream of short chunks), so decoding for a
client that stopped reading lasts about 1.25 x stall_timeout_s past the point its buffers filled, never to the
generation's end. A client that reads slowly but steadily acknowledges bytes and is never cut.

Where the connection cannot be read (no TCP_INFO), a stall is a write that has not returned for `timeout_s`: the
response counts its writes (`writes`, odd while one is under way: two integer increments per chunk). Output
buffering is then bounded by the ASGI server's flow control: uvicorn's `send` waits once the connection's write
buffer passes its high-water mark (64 KiB), and the response then pulls nothing more from the backend.

On a stall the watch logs one line (with the request's id), counts it, cancels the response (whose cleanup closes
the backend stream: an abort on every worker, the booking released) and drops the connection at once
(`ABORT_CONNECTION`, also put in the scope by coordinator.api.http_protocol): a graceful close would wait for a
buffer the client never drains.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import anyio
from starlette.types import Scope

from coordinator.api.client_progress import Progress

ABORT_CONNECTION = "pdserve.abort_connection"  # scope key: drops the request's connection now (transport.abort)
CLIENT_PROGRESS = "pdserve.client_progress"  # scope key: coordinator.api.client_progress's reader, or None
LOOKS_PER_TIMEOUT = 4
log = logging.getLogger("coordinator")


@dataclass(frozen=True)
class StallPolicy:
    timeout_s: float                 # server.stall_timeout_s
    on_stall: Callable[[], None]     # counts a stalled client (Metrics.stalled_clients.inc)


class StallWatch:
    """Watches what one response's client takes (its connection's acknowledged bytes, else the response's writes:
    `writes()`, odd while one is under way); on a stall, cancels `cancel` (the response's task group) and drops
    the connection named in `scope`."""

    def __init__(self, policy: StallPolicy, writes: Callable[[], int], scope: Scope,
                 cancel: anyio.CancelScope) -> None:
        self.policy = policy
        self._writes = writes
        self._scope = scope
        self._cancel = cancel
        self._client: Progress | None = scope.get(CLIENT_PROGRESS)
        self.stalled = False

    def _progress(self) -> tuple[bool, int]:
        """(bytes are waiting for the client, a count that moves whenever it takes some)."""
        writes = self._writes()
        if self._client is None:
            return writes % 2 == 1, writes
        pending, taken = self._client()
        return pending > 0 or writes % 2 == 1, taken

    async def run(self) -> None:
        timeout = self.policy.timeout_s
        _, seen = self._progress()
        since = anyio.current_time()
        while True:
            await anyio.sleep(timeout / LOOKS_PER_TIMEOUT)
            now, (waiting, taken) = anyio.current_time(), self._progress()
            if taken != seen or not waiting:  # the client took bytes, or none wait for it
                seen, since = taken, now
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
