"""The in-flight count and the drain API (app.state.lifecycle).

Owns `Lifecycle`: counts in-flight requests (each admitted request holds a `Ticket` until it ends);
`begin_drain()` makes new requests get 503 and /health report 503; `await wait_idle(timeout)` returns once every
in-flight request has ended. Shutdown sequence for `pdserve serve` on SIGTERM: `lc.begin_drain(); await
lc.wait_idle(drain_timeout_s)`, then stop uvicorn (`server.should_exit = True`); the app's lifespan then shuts the
backend down. One request's own life from the backend's first delta to its end: coordinator.api.lifecycle.
"""

from __future__ import annotations

import asyncio

from coordinator import errors


class Ticket:
    """One admitted request's place in the in-flight count; release() is idempotent."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self._lifecycle = lifecycle
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._lifecycle._release()


class Lifecycle:
    def __init__(self) -> None:
        self._draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def begin_drain(self) -> None:
        """Refuse new requests from now on (503 + Retry-After); in-flight ones continue. Idempotent."""
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if some still are after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return self._in_flight == 0
        return True

    def admit(self) -> Ticket:
        """Count a new request in, or raise the 503 of a draining server."""
        if self._draining:
            raise errors.unavailable("The server is shutting down; retry on another replica", 1.0, "draining")
        self._in_flight += 1
        self._idle.clear()
        return Ticket(self)

    def _release(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()
