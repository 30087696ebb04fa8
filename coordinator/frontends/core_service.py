"""CoreService: the core process's side of the HTTP frontends (`server.api_processes` > 1).

The core owns the ServingBackend (the Ray pools, admission, routing, every booking) and the tenants' rate-limit
buckets; each frontend process owns HTTP for its connections (parsing, tokenization, detokenization, SSE) and talks to
the core over one Link. Per frontend message:
- ("open", sid, group, request, trace_state): run backend.generate (group: generate_group) in a task of its own and
  send ("delta", sid, delta, trace_state | None) per delta (a group's delta is (choice index, delta); a single
  stream's delta without logprobs goes as ("tokens", sid, token ids, finish reason, trace_state | None)), the trace
  on a single stream's first and last delta; then ("end", sid, error | None, trace_state). A stream the frontend closes
  early sends nothing more.
- ("close", sid): cancel that task: the backend's own exit path aborts the request and releases what it booked.
- ("stop", sid, index): the group's choice `index` is over (GroupStream.stop).
- ("call", cid, name, args): one of CALLS; answered ("reply", cid, error | None, value) unless cid is None.
- ("collected", cid, families): a frontend's own metrics, asked for with ("collect", cid) when another frontend
  answers a scrape (`metrics_state`).
Every 0.5 s (and when the frontend connects) it sends ("state", backend.health(), backend.health_extra()), which
the frontends' /health answers from.
A frontend whose link ends (it exited or died) has every stream it opened cancelled and every tenant charge it held
settled as aborted, so nothing it started stays booked; its counters and histograms as of the last scrape that
collected them stay in every later scrape (`retired`), so a merged counter never goes down (Prometheus would read a
drop as a reset); what it counted after that scrape is lost with it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from coordinator.admission.tenants import Grant, TenantRegistry
from coordinator.config.faults_config import FaultsConfig
from coordinator.contract import BackendError, ServingBackend
from coordinator.errors import APIError
from coordinator.frontends.link import Link, LinkClosed
from coordinator.frontends.wire import encode_error, trace_from, trace_state
from coordinator.observability.metrics import merged

log = logging.getLogger("pdserve")
STATE_PERIOD_S = 0.5
COLLECT_TIMEOUT_S = 2.0  # a frontend too busy to send its metrics in this long is left out of that scrape


class _Frontend:
    """One connected frontend: its link, its streams' tasks and groups, its tenants' open charges."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.tasks: dict[int, asyncio.Task] = {}
        self.groups: dict[int, Any] = {}
        self.grants: dict[int, Grant] = {}
        self.collecting: dict[int, asyncio.Future] = {}  # its metrics asked for, by call id
        self.last_share: list | None = None  # the metric families it sent for the last scrape
        self.index: int | None = None  # its index among the frontends, once it said it is ready


class CoreService:
    CALLS = ("integrity", "kill_worker", "kill_rank", "set_faults", "set_role", "drain_worker", "undrain_worker",
             "revive_worker", "restart_workers", "restart_status", "request_view", "requests_in_flight",
             "tenant_admit", "tenant_settle", "metrics_state", "frontend_ready")

    def __init__(self, backend: ServingBackend, tenants: TenantRegistry) -> None:
        self.backend, self.tenants = backend, tenants
        self._frontends: set[_Frontend] = set()
        self._ids = itertools.count()  # tenant charges' and metrics collections' ids
        self._server: asyncio.AbstractServer | None = None
        self._pusher: asyncio.Task | None = None
        self._ready_changed = asyncio.Event()
        self._retired: list = []  # departed frontends' counters and histograms, summed (see the module docstring)

    async def start(self, path: str) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path, limit=1 << 30)
        self._pusher = asyncio.get_running_loop().create_task(self._push_state())

    async def close(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
        if self._server is not None:
            self._server.close()
        for fe in list(self._frontends):
            fe.link.close()
            await self._forget(fe)

    async def wait_ready(self, count: int, timeout: float) -> bool:
        """Until `count` frontends accept connections (True), or `timeout` passes (False)."""
        async def all_ready() -> None:
            while len({fe.index for fe in self._frontends if fe.index is not None}) < count:
                self._ready_changed.clear()
                await self._ready_changed.wait()
        try:
            await asyncio.wait_for(all_ready(), timeout)
            return True
        except TimeoutError:
            return False

    def hello(self) -> dict:
        b = self.backend
        return {"model_name": b.model_name, "model_path": b.model_path, "max_model_len": b.max_model_len,
                "vocab_size": b.vocab_size}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        fe = _Frontend(Link(reader, writer))
        self._frontends.add(fe)
        try:
            fe.link.send(("hello", self.hello()))  # the link is fresh: open, unless the frontend died already
            self._send_state(fe)
            async for batch in fe.link.batches():
                for message in batch:
                    self._handle(fe, message)
        finally:
            await self._forget(fe)

    def _handle(self, fe: _Frontend, message: tuple) -> None:
        kind = message[0]
        if kind == "open":
            _, sid, group, request, state = message
            fe.tasks[sid] = asyncio.get_running_loop().create_task(self._stream(fe, sid, group, request, state))
        elif kind == "close":
            task = fe.tasks.get(message[1])
            if task is not None:
                task.cancel()
        elif kind == "stop":
            group = fe.groups.get(message[1])
            if group is not None:
                group.stop(message[2])
        elif kind == "collected":
            future = fe.collecting.get(message[1])
            if future is not None and not future.done():
                future.set_result(message[2])
        elif kind == "call":
            asyncio.get_running_loop().create_task(self._call(fe, *message[1:]))
        else:
            log.error("frontend link: unknown message %r", kind)

    async def _stream(self, fe: _Frontend, sid: int, group: bool, request: Any, state: Any) -> None:
        trace = trace_from(state)
        send = fe.link.send

        def sink(token_ids: list[int]) -> None:  # the middle of a single stream, sent as its yielded deltas are
            try:
                send(("tokens", sid, token_ids, None, None))
            except LinkClosed:
                pass  # the frontend is gone: _forget cancels this stream
        request = replace(request, trace=trace, sink=None if group else sink)
        try:
            if group:
                run = fe.groups[sid] = self.backend.generate_group(request)
                async with aclosing(run):
                    async for pair in run:
                        send(("delta", sid, pair, None))
            else:
                first = True
                async with aclosing(self.backend.generate(request)) as deltas:
                    async for delta in deltas:
                        state = trace_state(trace) if first or delta.finish_reason is not None else None
                        if delta.logprobs or delta.prompt_logprobs is not None or delta.cached_tokens is not None:
                            send(("delta", sid, delta, state))
                        else:  # the common case as plain data: a dataclass costs ~8x more to pickle
                            send(("tokens", sid, delta.token_ids, delta.finish_reason, state))
                        first = False
            send(("end", sid, None, trace_state(trace)))
        except LinkClosed:
            pass  # the frontend is gone: _forget cancels the rest
        except Exception as e:  # noqa: BLE001 - every failure ends the stream with an error, never silently
            if not isinstance(e, (BackendError, APIError)):
                log.exception("request %s failed in the core", getattr(request, "request_id", sid))
            if not fe.link.closed:
                send(("end", sid, encode_error(e), trace_state(trace)))
        finally:
            fe.tasks.pop(sid, None)
            fe.groups.pop(sid, None)

    async def _call(self, fe: _Frontend, cid: int | None, name: str, args: tuple) -> None:
        try:
            if name not in self.CALLS:
                raise ValueError(f"unknown call {name!r}")
            value = getattr(self, f"_call_{name}")(fe, *args)
            if asyncio.iscoroutine(value):
                value = await value
            reply = ("reply", cid, None, value)
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            if not isinstance(e, (BackendError, APIError, ValueError)):  # a bug: its type and text stay here
                log.exception("call %s failed in the core", name)
            reply = ("reply", cid, encode_error(e), None)
        if cid is not None and not fe.link.closed:
            fe.link.send(reply)

    # ---- calls
    async def _call_integrity(self, fe: _Frontend) -> dict:
        return await self.backend.integrity()

    async def _call_kill_worker(self, fe: _Frontend, name: str) -> bool:
        return await self.backend.kill_worker(name)

    async def _call_kill_rank(self, fe: _Frontend, name: str, rank: int) -> bool:
        return await self.backend.kill_rank(name, rank)  # a ValueError (no such rank) reaches the caller

    async def _call_set_faults(self, fe: _Frontend, faults: FaultsConfig) -> None:
        await self.backend.set_faults(faults)

    async def _call_set_role(self, fe: _Frontend, name: str, role: str) -> bool:
        return await self.backend.set_role(name, role)  # a ValueError reaches the caller

    async def _call_drain_worker(self, fe: _Frontend, name: str) -> str | None:
        return await self.backend.drain_worker(name)  # a refusal (ValueError) reaches the caller

    async def _call_undrain_worker(self, fe: _Frontend, name: str) -> bool | None:
        return await self.backend.undrain_worker(name)

    async def _call_revive_worker(self, fe: _Frontend, name: str) -> bool | None:
        return await self.backend.revive_worker(name)

    async def _call_restart_workers(self, fe: _Frontend, drain_timeout_s: float, allow_pause: bool) -> list[str]:
        return await self.backend.restart_workers(drain_timeout_s, allow_pause)  # a refusal reaches the caller

    async def _call_restart_status(self, fe: _Frontend) -> dict:
        return await self.backend.restart_status()

    async def _call_request_view(self, fe: _Frontend, request_id: str) -> dict | None:
        return await self.backend.request_view(request_id)

    async def _call_requests_in_flight(self, fe: _Frontend) -> list[str]:
        return await self.backend.requests_in_flight()

    def _call_tenant_admit(self, fe: _Frontend, tenant: str, prompt_tokens: int, max_tokens: int,
                           max_tokens_given: bool, min_tokens: int) -> tuple[int, int]:
        """(the charge's id, the output it allows: Grant.output_tokens); raises the 429 or 400."""
        grant = self.tenants.admit(self.tenants.tenants[tenant], prompt_tokens, max_tokens, max_tokens_given,
                                   min_tokens)
        gid = next(self._ids)
        fe.grants[gid] = grant
        return gid, grant.output_tokens

    def _call_tenant_settle(self, fe: _Frontend, gid: int, completion_tokens: int, outcome: str,
                            prompt_processed: bool) -> None:
        grant = fe.grants.pop(gid, None)
        if grant is not None:
            grant.settle(completion_tokens, outcome, prompt_processed)

    def _call_frontend_ready(self, fe: _Frontend, index: int) -> None:
        fe.index = index
        self._ready_changed.set()

    async def _call_metrics_state(self, fe: _Frontend) -> dict:
        """For `fe`'s /metrics: the backend's and tenants' figures, and every other frontend's own share."""
        others = [other for other in self._frontends if other is not fe]
        shares = await asyncio.gather(*[self._collect(other) for other in others])
        return {"stats": self.backend.stats(), "tenants": self.tenants.usage(),
                "others": [share for share in shares if share is not None] + ([self._retired] if self._retired else [])}

    async def _collect(self, fe: _Frontend) -> list | None:
        cid = next(self._ids)
        future = fe.collecting[cid] = asyncio.get_running_loop().create_future()
        try:
            fe.link.send(("collect", cid))
            fe.last_share = await asyncio.wait_for(future, COLLECT_TIMEOUT_S)
            return fe.last_share
        except (TimeoutError, LinkClosed):
            log.warning("an HTTP frontend did not send its metrics within %.0f s", COLLECT_TIMEOUT_S)
            return None
        finally:
            fe.collecting.pop(cid, None)

    # ---- state and cleanup
    def _send_state(self, fe: _Frontend) -> None:
        try:
            extra = getattr(self.backend, "health_extra", dict)()  # the operator's part (the pools' scaling)
            fe.link.send(("state", self.backend.health(), extra))
        except LinkClosed:
            pass

    async def _push_state(self) -> None:
        while True:
            await asyncio.sleep(STATE_PERIOD_S)
            for fe in list(self._frontends):
                self._send_state(fe)

    async def _forget(self, fe: _Frontend) -> None:
        if fe not in self._frontends:
            return
        self._frontends.discard(fe)
        tasks = list(fe.tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for grant in fe.grants.values():
            grant.settle(0, "aborted", prompt_processed=False)
        fe.grants.clear()
        if fe.last_share:
            monotonic = [f for f in fe.last_share if f.type in ("counter", "histogram")]  # not its gauges
            self._retired = list(merged(self._retired, [monotonic])) if self._retired else monotonic

