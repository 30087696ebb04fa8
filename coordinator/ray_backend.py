"""RayBackend: the ServingBackend made of Ray actor pools (disaggregated: prefill + decode; collocated: one pool).

Owns the request's path between workers: admission, routing, the prefill call (first token streams at once),
the decode call (the decode worker pulls the KV, then prefill releases it), and the token streams, which arrive
from each decode worker in batches through one long-poll loop per worker. Every path ends: a dead worker fails
its requests, a closed stream aborts the request on both sides.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from coordinator.backend import BackendError, GenerateRequest, Overloaded, TokenDelta
from coordinator.pools import Pools
from coordinator.router import Router, WorkerState
from coordinator.serve_config import ServeConfig
from engine.scheduler import StepOutput

POLL_TIMEOUT_S = 0.5
STATS_PERIOD_S = 1.0
ADMISSION_RETRY_S = 0.01


class RayBackend:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.pools = Pools(config)
        self.model_name = config.model
        self.model_path = ""
        self.max_model_len = 0
        self.vocab_size = 0
        self.router: Router | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: set[asyncio.Task] = set()
        self._in_flight = 0
        self._transfer: dict = {}
        self._errors: dict[str, int] = {}
        self._ids = itertools.count()

    async def start(self) -> None:
        await self.pools.start()
        infos = [w.info for w in self.pools.all_workers]
        self.model_path = self.pools.model_path
        # a request must fit one worker's whole KV cache (decode also books one block ahead): larger ones are
        # refused at the HTTP edge as not fitting the context, instead of waiting for room that never comes
        capacity = min(i.num_kv_blocks * i.block_size - i.block_size for i in infos)
        self.max_model_len = min(min(i.max_model_len for i in infos), capacity)
        self.vocab_size = min(i.vocab_size for i in infos)
        self.router = Router(infos[0].block_size)
        for w in self.pools.decode:
            self._spawn(self._poll_loop(w))
        self._spawn(self._stats_loop())

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for q in self._queues.values():
            q.put_nowait(BackendError("the server is shutting down"))
        await self.pools.shutdown()

    def stats(self) -> dict:
        workers = []
        for w in self.pools.all_workers:
            load = w.load
            workers.append({"name": w.name, "role": w.info.role, "alive": w.alive, "served": w.served,
                            "queued_prompt_tokens": load.queued_prompt_tokens if load else 0,
                            "running": load.num_running if load else 0,
                            "free_blocks": load.free_blocks if load else w.info.num_kv_blocks,
                            "total_blocks": w.info.num_kv_blocks})
        return {"workers": workers, "transfer": dict(self._transfer), "queue_length": self._in_flight,
                "errors": dict(self._errors),
                "prefix_affinity_hits": self.router.affinity_hits if self.router else 0}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if self._in_flight >= self.config.admission.max_queue:
            raise Overloaded(f"{self._in_flight} requests in flight (admission.max_queue)", retry_after_s=1.0)
        rid = f"{request.request_id}-{next(self._ids)}"  # unique on the workers even if a client reuses ids
        self._in_flight += 1
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        touched: list[tuple[WorkerState, str]] = []  # (worker, how to end it there) for cleanup
        finished = False
        try:
            if self.config.mode == "collocated":
                decode = await self._admit(request, promise=False)
                touched.append((decode, "abort"))
                decode.requests.add(rid)
                await self._call(decode, decode.handle.generate.remote(rid, request.prompt_token_ids, request.params))
            else:
                async for delta in self._prefill_then_decode(rid, request, queue, touched):
                    yield delta
                    if delta.finish_reason:
                        finished = True
                        return
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield TokenDelta(out.new_token_ids, out.new_logprobs, out.finish_reason)
                if out.finish_reason is not None:
                    finished = True
                    return
        finally:
            self._queues.pop(rid, None)
            self._in_flight -= 1
            for worker, action in touched:
                worker.requests.discard(rid)
                if not finished and worker.alive:
                    self._spawn(_quietly(getattr(worker.handle, action).remote(rid)))

    async def _prefill_then_decode(self, rid: str, request: GenerateRequest, queue: asyncio.Queue,
                                   touched: list) -> AsyncIterator[TokenDelta]:
        prompt = request.prompt_token_ids
        decode = await self._admit(request, promise=True)  # decode room first: never prefill what cannot be decoded
        prefill = self.router.pick_prefill(prompt, self.pools.prefill)
        touched.append((prefill, "abort"))
        prefill.outstanding_tokens += len(prompt)
        try:
            result = await self._call(prefill, prefill.handle.prefill.remote(rid, prompt, request.params))
        finally:
            prefill.outstanding_tokens -= len(prompt)
        prefill.load = result.load
        first = TokenDelta([result.first_token_id], [result.first_logprob] if result.first_logprob else [],
                           result.finish_reason)
        if result.finish_reason is not None:
            decode.promised_blocks -= self._blocks(request)
            yield first
            return
        touched.append((decode, "abort"))
        decode.requests.add(rid)
        try:
            yield first
            decode.load = await self._call(decode, decode.handle.decode.remote(
                rid, prompt, request.params, result.first_token_id, result.first_logprob, prefill.name,
                result.block_ids))
        finally:
            decode.promised_blocks -= self._blocks(request)
            touched.remove((prefill, "abort"))  # pulled (or failed): prefill only needs to release
            self._spawn(_quietly(prefill.handle.release.remote(rid)))

    async def _admit(self, request: GenerateRequest, promise: bool) -> WorkerState:
        """Wait (bounded) until a decode worker has room for the request's KV; book it there if `promise`
        (disaggregated: the blocks are reserved by the worker only later, when the KV arrives)."""
        needed = self._blocks(request)
        deadline = asyncio.get_running_loop().time() + self.config.admission.timeout_s
        while True:
            worker = self.router.pick_decode(self.pools.decode, needed)
            if worker is not None:
                worker.promised_blocks += needed if promise else 0
                return worker
            if asyncio.get_running_loop().time() > deadline:
                raise Overloaded("no decode worker has room for this request's KV cache", retry_after_s=1.0)
            await asyncio.sleep(ADMISSION_RETRY_S)

    def _blocks(self, request: GenerateRequest) -> int:
        bs = self.router.block_size
        return -(-len(request.prompt_token_ids) // bs) + 1

    async def _call(self, worker: WorkerState, ref: Any) -> Any:
        try:
            return await ref
        except RayActorError as e:
            worker.alive = False
            self._count_error("worker_died")
            raise BackendError(f"worker {worker.name} died: {e}") from None
        except RayTaskError as e:
            self._count_error("worker_error")
            raise BackendError(f"worker {worker.name} failed: {e.cause!r}") from None

    async def _poll_loop(self, worker: WorkerState) -> None:
        while True:
            try:
                outputs, load = await worker.handle.poll.remote(POLL_TIMEOUT_S)
            except (RayActorError, RayTaskError) as e:
                worker.alive = False
                self._count_error("worker_died")
                for rid in list(worker.requests):
                    queue = self._queues.get(rid)
                    if queue is not None:
                        queue.put_nowait(BackendError(f"decode worker {worker.name} died: {e}"))
                return
            worker.load = load
            for out in outputs:
                self._deliver(out)

    def _deliver(self, out: StepOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is not None:  # else: the request was closed already; the worker was told to abort it
            queue.put_nowait(out)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(STATS_PERIOD_S)
            totals: dict[str, float] = {}
            for w in self.pools.all_workers:
                if not w.alive:
                    continue
                try:
                    metrics = await w.handle.transfer_metrics.remote()
                    if w.info.role == "prefill":  # decode loads arrive with every poll already
                        w.load = await w.handle.load.remote()
                except (RayActorError, RayTaskError):
                    continue
                _accumulate(totals, metrics)
            self._transfer = totals

    def _count_error(self, kind: str) -> None:
        self._errors[kind] = self._errors.get(kind, 0) + 1

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _accumulate(totals: dict[str, float], metrics: dict) -> None:
    """Add one agent's snapshot into pool-wide figures: top-level numbers, and per operation
    `<op>_<count|bytes|seconds_sum|failures>` (summed) and `<op>_seconds_max` (max)."""
    flat = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
    for op, fields in (metrics.get("ops") or {}).items():
        flat |= {f"{op}_{k}": v for k, v in fields.items() if isinstance(v, int | float)}
    for key, value in flat.items():
        totals[key] = max(totals.get(key, 0), value) if key.endswith("_max") else totals.get(key, 0) + value


async def _quietly(ref: Any) -> None:
    try:
        await ref
    except (RayActorError, RayTaskError, asyncio.CancelledError):
        pass

