"""CoreBackend: the ServingBackend of an HTTP frontend process, served by the core process over a Link.

Owns the frontend's side of coordinator.frontends.core_service's messages: each stream it opens (generate,
generate_group) gets a stream id and a queue that the link's reader fills; closing a stream before its end sends
("close", sid) so the core aborts it; a group's stop(index) sends ("stop", sid, index). Calls (admin routes, tenant
charges, the figures for /metrics) are request/reply; the core's ("collect", cid) is answered with this process's
own metric families (`local_metrics`), for another frontend's scrape. health() answers from the state the core
pushes every 0.5 s. If the link ends (the core is gone), every open stream and call fails with a BackendError and
`on_lost` runs: the frontend process then exits, since nothing it serves can go on without the core.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from coordinator.contract import BackendError, GenerateRequest, TokenDelta
from coordinator.frontends.link import Link, LinkClosed
from coordinator.frontends.wire import decode_error, trace_state

LOST = ("BackendError", "the server's core process is gone")


class CoreBackend:
    def __init__(self, link_path: str, process_index: int = 0) -> None:
        self.link_path = link_path
        self.process_index = process_index  # which HTTP process this is (/health says it)
        self.model_name = self.model_path = ""
        self.max_model_len = self.vocab_size = 0
        self.on_lost: Callable[[], None] | None = None
        self.local_metrics: Callable[[], list] | None = None  # this process's own metric families (the app's)
        self._link: Link | None = None
        self._ids = itertools.count()
        self._streams: dict[int, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._health: tuple[bool, list[dict]] = (False, [])
        self._health_extra: dict = {}  # the operator's part of /health beyond the workers (the pools' scaling)
        self._figures: dict = {"stats": None, "tenants": {}, "others": []}
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        self._link = await Link.connect(self.link_path)
        batches = self._link.batches()
        first = await anext(batches)  # ("hello", facts) comes first
        facts = first[0][1]
        self.model_name, self.model_path = facts["model_name"], facts["model_path"]
        self.max_model_len, self.vocab_size = facts["max_model_len"], facts["vocab_size"]
        self._dispatch(first[1:])
        self._reader = asyncio.get_running_loop().create_task(self._read(batches))

    async def shutdown(self) -> None:
        self.on_lost = None  # this process is ending anyway
        if self._link is not None:
            self._link.close()
        if self._reader is not None:
            self._reader.cancel()

    # ---- streams
    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        return self._single(request)

    def generate_group(self, request: GenerateRequest) -> RemoteGroup:
        return RemoteGroup(self, request)

    def open(self, request: GenerateRequest, group: bool) -> tuple[int, asyncio.Queue]:
        sid, queue = next(self._ids), asyncio.Queue()
        self._send(("open", sid, group, replace(request, trace=None), trace_state(request.trace)))
        self._streams[sid] = queue
        return sid, queue

    def close(self, sid: int, ended: bool) -> None:
        self._streams.pop(sid, None)
        if not ended and self._link is not None and not self._link.closed:
            self._link.send(("close", sid))

    def stop(self, sid: int, index: int) -> None:
        if sid in self._streams and self._link is not None and not self._link.closed:
            self._link.send(("stop", sid, index))

    async def _single(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        trace = request.trace
        sid, queue = self.open(request, group=False)
        ended = False
        try:
            while True:
                message = await queue.get()
                if message[0] == "end":
                    ended = True
                    if trace is not None and message[3] is not None:
                        trace.adopt(message[3])
                    raise decode_error(message[2] or ("BackendError", "the stream ended without a finish reason"))
                delta = message[2]
                if trace is not None and message[3] is not None:
                    trace.adopt(message[3])
                if delta.finish_reason is None:
                    delta = _merged(delta, queue, trace)  # a frontend that fell behind takes what is queued at once
                ended = delta.finish_reason is not None
                yield delta
                if ended:
                    return
        finally:
            self.close(sid, ended)

    # ---- calls and state
    async def call(self, name: str, *args: Any) -> Any:
        cid = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[cid] = future
        try:
            self._send(("call", cid, name, args))
            error, value = await future
        finally:
            self._calls.pop(cid, None)
        if error is not None:
            raise decode_error(error)
        return value

    def notify(self, name: str, *args: Any) -> None:
        """A call whose answer nobody waits for (a tenant charge's settlement)."""
        if self._link is not None and not self._link.closed:
            self._link.send(("call", None, name, args))

    def health(self) -> tuple[bool, list[dict]]:
        return self._health

    def health_extra(self) -> dict:
        return self._health_extra

    def stats(self) -> dict | None:
        """The backend's figures as of the last refresh() (the /metrics route refreshes before each scrape)."""
        return self._figures["stats"]

    def tenant_usage(self) -> dict:
        return self._figures["tenants"]

    async def refresh(self) -> list:
        """Before a scrape: the core's figures (for stats() and tenant_usage()); returns the other frontends'
        local metric families, for Metrics.exposition."""
        try:
            self._figures = await self.call("metrics_state")
        except BackendError:  # the core is gone: this scrape shows this process alone
            self._figures = {"stats": None, "tenants": {}, "others": []}
        return self._figures["others"]

    async def kill_worker(self, name: str) -> bool:
        return await self.call("kill_worker", name)

    async def kill_rank(self, name: str, rank: int) -> bool:
        return await self.call("kill_rank", name, rank)

    async def set_faults(self, faults: Any) -> None:
        await self.call("set_faults", faults)

    async def set_role(self, name: str, role: str) -> bool:
        return await self.call("set_role", name, role)

    async def integrity(self) -> dict:
        return await self.call("integrity")

    async def drain_worker(self, name: str) -> str | None:
        return await self.call("drain_worker", name)

    async def undrain_worker(self, name: str) -> bool | None:
        return await self.call("undrain_worker", name)

    async def revive_worker(self, name: str) -> bool | None:
        return await self.call("revive_worker", name)

    async def restart_workers(self, drain_timeout_s: float, allow_pause: bool) -> list[str]:
        return await self.call("restart_workers", drain_timeout_s, allow_pause)

    async def restart_status(self) -> dict:
        return await self.call("restart_status")

    async def request_view(self, request_id: str) -> dict | None:
        return await self.call("request_view", request_id)

    async def requests_in_flight(self) -> list[str]:
        return await self.call("requests_in_flight")

    # ---- the link
    def _send(self, message: tuple) -> None:
        if self._link is None or self._link.closed:
            raise BackendError(LOST[1])
        try:
            self._link.send(message)
        except LinkClosed:
            raise BackendError(LOST[1]) from None

    async def _read(self, batches: AsyncIterator[list]) -> None:
        try:
            async for batch in batches:
                self._dispatch(batch)
        finally:
            self._lost()

    def _dispatch(self, batch: list) -> None:
        for message in batch:
            kind = message[0]
            if kind in ("tokens", "delta", "end"):
                queue = self._streams.get(message[1])
                if queue is not None:
                    if kind == "tokens":
                        message = ("delta", message[1], TokenDelta(message[2], [], message[3]), message[4])
                    queue.put_nowait(message)
            elif kind == "reply":
                future = self._calls.get(message[1])
                if future is not None and not future.done():
                    future.set_result((message[2], message[3]))
            elif kind == "state":
                self._health, self._health_extra = message[1], message[2]
            elif kind == "collect" and self.local_metrics is not None:
                self._send(("collected", message[1], self.local_metrics()))

    def _lost(self) -> None:
        for sid, queue in list(self._streams.items()):
            queue.put_nowait(("end", sid, LOST, None))
        for future in self._calls.values():
            if not future.done():
                future.set_result((LOST, None))
        self._health = (False, [])
        if self.on_lost is not None:
            self.on_lost()


class RemoteGroup:
    """A GroupStream served by the core: (choice index, delta) pairs until every choice ended."""

    def __init__(self, backend: CoreBackend, request: GenerateRequest) -> None:
        self._backend, self._request = backend, request  # opened at the first __anext__, on the event loop (the
        self._sid: int | None = None                     # HTTP layer may build the group in a thread)
        self._queue: asyncio.Queue | None = None
        self._ended = False

    def __aiter__(self) -> RemoteGroup:
        return self

    async def __anext__(self) -> tuple[int, TokenDelta]:
        if self._ended:
            raise StopAsyncIteration
        if self._queue is None:
            self._sid, self._queue = self._backend.open(self._request, group=True)
        message = await self._queue.get()
        if message[0] == "end":
            self._ended = True
            self._backend.close(self._sid, ended=True)
            if message[2] is not None:
                raise decode_error(message[2])
            raise StopAsyncIteration
        return message[2]

    def stop(self, index: int) -> None:
        if not self._ended and self._sid is not None:
            self._backend.stop(self._sid, index)

    async def aclose(self) -> None:
        if not self._ended:
            self._ended = True
            if self._sid is not None:
                self._backend.close(self._sid, ended=False)


def _merged(delta: TokenDelta, queue: asyncio.Queue, trace: Any) -> TokenDelta:
    """`delta` and the deltas queued behind it (up to an end or an error, which stay queued), as one."""
    tokens, logprobs, finish = list(delta.token_ids), list(delta.logprobs), None
    while finish is None and not queue.empty() and queue._queue[0][0] == "delta":  # type: ignore[attr-defined]
        message = queue.get_nowait()
        if trace is not None and message[3] is not None:
            trace.adopt(message[3])
        tokens += message[2].token_ids
        logprobs += message[2].logprobs
        finish = message[2].finish_reason
    if len(tokens) == len(delta.token_ids):
        return delta
    return TokenDelta(tokens, logprobs, finish, delta.prompt_logprobs, delta.cached_tokens)
