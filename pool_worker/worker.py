"""Worker: the Ray actor every pool is made of. One engine stepped by one AsyncEngine loop, one KV agent per rank
(none when collocated: nothing moves between workers), the coordinator's output stream, and the two duties: the
prefill duty (prefill_pool.prefills: prompts run for another worker, their KV pinned until taken or pushed) and the
decode duty (decode_pool.decodes: requests handed over from a prefill elsewhere, and requests run here whole).

Every worker can do both; which one it does is what the coordinator sends it (its role: prefill, decode or both),
so a role can change while serving without a restart. Its RPCs only enqueue work on the engine loop and await the
results. One step's outputs are split by owner: a prefill's first token resolves its prefill() call (the event
loop), every other delta goes onto the stream from the engine thread (Decodes.stream_step).
Shared here once: the load reported with every reply, aborts and shutdown. Start-up (weights, KV cache, graphs,
agents, duties, stream) is pool_worker.worker_start's mixin; the side calls (transfer peers, integrity checks,
drills, polled figures) are pool_worker.worker_operations'. The log lines are warnings: a Ray worker's root logger
has no handler, so only Python's last-resort one (warnings and above) reaches the server's log (Ray forwards its
stderr).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from decode_pool.decodes import Decodes
from decode_pool.reservations import RequestEnded
from decode_pool.worker_stream import WorkerStream
from engine.async_engine import AsyncEngine
from engine.core.request import TokenLogprob
from engine.core.request_timing import Durations
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import StepOutput
from engine.engine_config import EngineConfig
from engine.gc_pauses import GcPauses
from engine.load import EngineLoad, WorkerInfo
from kvtransfer import AgentConfig
from pool_worker.call_jitter import CallJitter
from pool_worker.orphans import Adoption, abort_held
from pool_worker.prefix_share import PrefixShare, PrefixSource
from pool_worker.start_phases import before_start, imports_began
from pool_worker.worker_operations import WorkerOperations
from pool_worker.worker_start import WorkerStart
from prefill_pool.prefills import PrefillResult, Prefills

if TYPE_CHECKING:
    from kvtransfer.worker_agents import WorkerAgents

log = logging.getLogger("pdserve")


class Worker(WorkerStart, WorkerOperations):
    def __init__(self, name: str, engine_config: EngineConfig, agent_config: AgentConfig | None, num_threads: int,
                 admission_timeout_s: float, role: str = "decode", stream: bool = False, fleet: str = "",
                 requested_at: float | None = None) -> None:
        """`requested_at`: the coordinator's wall-clock time when it asked Ray for this actor (for the start's
        `schedule` and `process` phases; None: not reported)."""
        self.name = name
        self._phases = before_start(requested_at)  # seconds per start-up phase so far
        self._imports_began = imports_began(requested_at)
        self.fleet = fleet  # the fingerprint of the fleet it belongs to (coordinator.backend.fleet); "": none
        self.role = role  # the role it started in ("prefill", "decode", "collocated", "mixed"), for WorkerInfo
        self._engine_config = engine_config
        self._agent_config = agent_config  # None when collocated: no transfers
        self._num_threads = num_threads
        self._admission_timeout_s = admission_timeout_s
        self._use_stream = stream  # outputs and commands on a stream with the coordinator (decode_pool.worker_stream)
        self._gc = GcPauses()  # this process's collector pauses, reported with every load
        self.loop: AsyncEngine | None = None
        self.agents: WorkerAgents | None = None  # one KV agent per TP rank, driven as one
        self.prefills: Prefills | None = None
        self.decodes: Decodes | None = None
        self.share: PrefixShare | None = None  # prefixes lent to and fetched from other workers (with agents)
        self._stream: WorkerStream | None = None
        self._tasks: list[asyncio.Task] = []  # kept: not collected while they run
        self.jitter = CallJitter()  # a wait before each request call: faults.call_jitter_s (WorkerOperations)
        self._info: WorkerInfo | None = None  # what start() (or a spare's take_over_slot()) reported

    async def take_over_slot(self, name: str) -> WorkerInfo:
        """A warm spare takes over worker slot `name` (coordinator.backend.spares): from now on it is that worker to
        the coordinator and, its transfer metadata renamed, to its peers; engine, agents and stream are kept."""
        self.name = self.prefills.name = self.decodes.name = name
        if self.agents is not None:
            self.agents.rename(name)
        self._info = replace(self._info, name=name, agent_metadata=self.agents.metadata() if self.agents else None)
        return self._info

    async def adopt(self, fleet: str) -> Adoption | None:
        """A new coordinator takes this worker over (pool_worker.orphans): unless `fleet` is another fingerprint
        than its own, every request held for the dead one is aborted and the stream's unsent backlog dropped.
        None while it is still starting (its start was the dead coordinator's call)."""
        if self._info is None or self.loop is None:
            return None
        if fleet != self.fleet:
            return Adoption(self.fleet, None)
        aborted = await abort_held(self)
        if self._stream is not None:
            self._stream.drop_backlog()
        return Adoption(self.fleet, self._info, tuple(aborted), await self.check_integrity(), await self.load())

    # ---- the prefill duty (prefill_pool.prefills)
    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      prior_output_ids: Sequence[int] = (), priority: int = 0,
                      fork_params: Sequence[SamplingParams] | None = None, push: bool = False,
                      fetch: PrefixSource | None = None) -> PrefillResult:
        """Prefill and sample the first token; its blocks stay pinned for decode. `push`: a target for its KV may
        come (push_to) while it runs. `fetch`: another worker lends the prompt's leading blocks: they are pulled
        into this worker's prefix cache first (the result's phases then start with `kv_restore`)."""
        await self.jitter.wait()  # faults.call_jitter_s: calls run out of order (drills)
        fetched = ()
        if fetch is not None and self.share is not None and not self.decodes.reservations.ended(request_id):
            fetched = await self.share.fetch_from(fetch, [*prompt_token_ids, *prior_output_ids])
        if self.decodes.reservations.ended(request_id):  # its abort overtook this call (or the fetch) and found
            raise RequestEnded(f"request {request_id} was aborted before its prefill arrived")  # nothing to pin
        result = await self.prefills.prefill(request_id, prompt_token_ids, params, prior_output_ids, priority,
                                             fork_params, push)
        return replace(result, phases=fetched + tuple(result.phases)) if fetched else result

    async def lend_prefix(self, lease_id: str, token_ids: list[int]) -> list[int]:
        """Hold the longest run of `token_ids`' whole blocks this worker has for another worker's fetch (a prefill
        call's `fetch`): the blocks, in order ([]: it holds none, or moves no KV); end_lease gives them back."""
        await self.jitter.wait()
        return await self.share.lend(lease_id, token_ids) if self.share is not None else []

    async def end_lease(self, lease_id: str) -> bool:
        await self.jitter.wait()
        return await self.share.end(lease_id) if self.share is not None else False

    async def push_to(self, request_id: str, remote: str, remote_block_ids: list[int], skip: int = 0) -> bool:
        """Name the decode worker's booked blocks to push `request_id`'s KV into, the first `skip` left out (its
        prefix cache holds them: Decodes.reserve_for_push)."""
        await self.jitter.wait()
        return self.prefills.push_to(request_id, remote, remote_block_ids, skip)

    async def push_outcome(self, request_id: str) -> tuple[bool, float]:
        """How a pushed request's writes ended (PrefillResult.pushed: they were under way): (all landed, seconds)."""
        await self.jitter.wait()
        return await self.prefills.push_outcome(request_id)

    async def release(self, request_id: str) -> bool:
        """Decode has the KV: free the pinned blocks."""
        await self.jitter.wait()
        return await self.prefills.release(request_id)

    # ---- the decode duty (decode_pool.decodes)
    async def reserve(self, request_id: str, token_ids: list[int]) -> None:
        """Book the blocks of the KV of `token_ids` (prompt, then prior outputs) for a handoff to come."""
        await self.jitter.wait()
        self.decodes.reserve(request_id, token_ids)

    async def reserve_for_push(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                               prior_output_ids: Sequence[int] = (), priority: int = 0
                               ) -> tuple[str, list[int], int]:
        await self.jitter.wait()
        return await self.decodes.reserve_for_push(request_id, prompt_token_ids, params, prior_output_ids,
                                                   priority)

    async def decode(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, first_token_id: int,
                     first_logprob: TokenLogprob | None, peer: str, peer_block_ids: list[int],
                     prior_output_ids: Sequence[int] = (), pushed: bool = False, priority: int = 0) -> EngineLoad:
        await self.jitter.wait()
        await self.decodes.decode(request_id, prompt_token_ids, params, first_token_id, first_logprob, peer,
                                  peer_block_ids, prior_output_ids, pushed, priority)
        return await self.load()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prior_output_ids: Sequence[int] = (), priority: int = 0) -> EngineLoad:
        await self.jitter.wait()
        await self.decodes.generate(request_id, prompt_token_ids, params, prior_output_ids, priority)
        return await self.load()

    async def prefill_group(self, group_id: str, prompt_token_ids: list[int], params: list[SamplingParams],
                            priority: int = 0) -> StepOutput:
        await self.jitter.wait()
        return await self.decodes.prefill_group(group_id, prompt_token_ids, params, priority)

    async def decode_group(self, group_id: str, choice_ids: list[str], prompt_token_ids: list[int],
                           params: list[SamplingParams], firsts: list[tuple[int, TokenLogprob | None]],
                           peer: str | None, peer_block_ids: list[int], priority: int = 0) -> EngineLoad:
        await self.jitter.wait()
        await self.decodes.decode_group(group_id, choice_ids, prompt_token_ids, params, firsts, peer,
                                        peer_block_ids, priority)
        return await self.load()

    async def poll(self, timeout_s: float) -> tuple[list[tuple], EngineLoad, dict[str, Durations]]:
        return await self.decodes.poll(timeout_s)

    # ---- shared
    async def abort(self, request_id: str) -> bool:
        """End a request here, whichever duty holds it; its blocks are freed once no transfer touches them."""
        await self.jitter.wait()
        if self.prefills.owns(request_id):
            freed = await self.prefills.abort(request_id)
            if freed:
                await self.decodes.report_load()  # the load reaches the coordinator on the decode duty's channel
            return freed
        # the decode duty remembers the id: a prefill, booking, handoff or generate of it that this abort overtook
        # (Ray orders no async actor's calls) is refused when it arrives
        return await self.decodes.abort(request_id)

    async def load(self) -> EngineLoad:
        return self._reported(await self.loop.call(lambda e: e.load()))

    async def shutdown(self) -> None:
        if self.loop is not None:
            self.loop.close()
        if self.agents is not None:
            self.agents.close()
        if self._stream is not None:
            self._stream.close()

    # ---- internals
    def _wake_engine(self) -> None:
        """From any thread: the engine thread looks at its work again now (held requests may start)."""
        try:
            self.loop.post(lambda e: None)
        except RuntimeError:  # the loop has stopped
            pass

    def _reported(self, load: EngineLoad) -> EngineLoad:
        """The engine's load with this process's garbage-collector figures (engine.gc_pauses)."""
        return replace(load, **self._gc.figures())

    def _command(self, command: tuple) -> None:
        self.decodes.command(command)

    def _step_hook(self, outputs: list[StepOutput], load: EngineLoad) -> list[StepOutput] | None:
        """The engine thread's look at each step's outputs: pushes' notifications (KVPushes.sampled), then, with a
        stream, every delta onto it; what is left goes to the event loop (_on_outputs)."""
        if self.prefills.pushes is not None:
            self.prefills.pushes.sampled(outputs, load)
        if self._stream is None:
            return None
        self.decodes.stream_step(outputs, load)
        return [o for o in outputs if o.prefill_only]  # prefills' first tokens (a local group's too): the loop's

    def _on_outputs(self, outputs: list[StepOutput], load: EngineLoad) -> None:
        mine, prefills = [], []
        for o in outputs:  # each output once: a local group prefill's is the decode duty's, other prefills' not
            (mine if self.decodes.takes(o) else prefills).append(o)
        if prefills:
            self.prefills.on_outputs(prefills, load)
        self.decodes.on_outputs(mine, load)
