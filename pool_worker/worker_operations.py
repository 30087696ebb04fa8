"""The operator's and the coordinator's side calls on a worker (pool_worker.worker.Worker's mixin): its transfer
peers (add, drop, replace, each connection's steps logged in one line), integrity checks, drills (kill a rank,
inject faults), and the figures the coordinator polls besides the load (host-tier changes, transfer metrics).

Expects of the class it is mixed into: `name`, `loop` (the engine's AsyncEngine), `agents` (WorkerAgents, or None
when collocated) and `prefills` (prefill_pool.prefills.Prefills).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtransfer.step_times import StepTimes
from pool_worker.call_jitter import CallJitter

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from kvtransfer.worker_agents import WorkerAgents
    from prefill_pool.prefills import Prefills

log = logging.getLogger("pdserve")


class WorkerOperations:
    name: str
    loop: AsyncEngine
    agents: WorkerAgents | None
    prefills: Prefills
    jitter: CallJitter

    async def add_peer(self, agent_metadata: bytes) -> str:
        """Connect every rank to another worker's ranks (its GroupMetadata): to pull from it, or push to it."""
        return await self._timed_peer_call("add_peer", self.agents.add_peer, agent_metadata)

    async def drop_peer(self, name: str) -> bool:
        """A peer died: forget its agent now (transfers in flight with it fail with PeerLost) and unmap its cache,
        so nothing here keeps the dead worker's GPU memory alive for its replacement to find taken."""
        return await asyncio.to_thread(self.agents.remove_peer, name)

    async def replace_peer(self, name: str, agent_metadata: bytes) -> str:
        """A peer was replaced: drop the connection to its dead agent, then connect to the new one (same name)."""
        return await self._timed_peer_call("replace_peer", self.agents.replace_peer, name, agent_metadata)

    async def check_integrity(self) -> dict[str, int]:
        return await self.loop.call(lambda e: e.check_integrity())

    async def kill_rank(self, rank: int) -> int:
        """Drills: SIGKILL tensor-parallel rank `rank` (1..N-1) of this worker; its pid. ValueError without it."""
        return self.loop.kill_rank(rank)

    async def set_faults(self, kv: dict, prefill_error_fraction: float = 0.0, seed: int = 0,
                         step_delay_s: float = 0.0, call_jitter_s: float = 0.0) -> None:
        """Inject failures from now on: this fraction of prefill calls fail, the transfer agent's `kv` faults,
        each engine step sleeps `step_delay_s` (a throttled worker, for the straggler watch), and each request call
        first waits a random time up to `call_jitter_s` (calls run out of order)."""
        self.prefills.set_faults(prefill_error_fraction, seed)
        self.jitter = CallJitter(call_jitter_s, seed)
        self.loop.engine.step_delay_s = step_delay_s
        if self.agents is not None:
            await asyncio.to_thread(self.agents.set_faults, kv)

    async def host_tier_changes(self) -> tuple[list[bytes], list[bytes]]:
        """The block hashes its engine's host tier added and evicted since the last call (engine.core.host_tier),
        for the coordinator's prefix index; none without a tier."""
        return await self.loop.call(lambda e: e.host_tier.take_changes() if e.host_tier is not None else ([], []))

    async def transfer_metrics(self) -> list[dict]:
        """Every rank's transfer figures (rank 0's with the push counters); none when collocated."""
        if self.agents is None:
            return []
        ranks = await asyncio.to_thread(self.agents.metrics)
        ranks[0] = ranks[0] | self.prefills.counters()
        return ranks

    async def _timed_peer_call(self, what: str, call: Callable[..., str], *args: Any) -> str:
        """`call(*args, steps)` (WorkerAgents.add_peer / replace_peer) on a thread; its steps logged in one line,
        after `thread_wait` (until the thread ran it)."""
        steps = StepTimes()
        began = time.monotonic()

        def run() -> str:
            steps.add("thread_wait", time.monotonic() - began)
            return call(*args, steps)

        peer = await asyncio.to_thread(run)
        log.warning("worker %s: %s %s %.3f s, its steps: %s", self.name, what, peer, time.monotonic() - began, steps)
        return peer
