"""WorkerAgents: the KV agents of one pool worker, one per tensor-parallel rank, driven as one.

A worker of TP size N has N caches (each rank's shard, holding its KV heads: engine.kv_heads) and so N agents:
rank 0's lives here, in the worker's process; rank r's lives in follower r's process (`RankAgents`, started there
through the engine's rank services: engine.runner.rank_service). Rank r's agent is named "<worker>.rank<r>", or
just "<worker>" at TP=1. The worker's metadata is a GroupMetadata (kvtransfer.tp_group) listing every rank.

Pulls: `read(peer, ...)` has every local rank pull exactly the heads it holds from the peer's ranks that hold
them (`read_from_group`, spread by rank so replicated heads are served by different peer ranks), all at once, and
resolves once every rank's pieces have ended, so on failure no rank is still writing into the blocks the caller
is about to free. At TP=1 over cuda_ipc the pull is done when its GPU copies are (kvtransfer.handle), and
`GroupRead.landed()` watches their events on the caller's own event loop, not through the agent's loop thread.
Connections: a local rank connects only to the peer ranks it will pull from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec

from .agent import AgentConfig, KVAgent
from .cache import event_done
from .errors import BadDescriptor, TransferTimeout
from .gpu_visibility import put_first
from .handle import TransferHandle
from .metadata import AgentMetadata
from .step_times import StepTimes, maybe_step
from .tp_group import GroupMetadata, read_from_group
from .worker_setup import start_agent

CALL_TIMEOUT_S = 120.0  # a follower's metadata or connection answer (a connect has its own shorter deadline)
SPIN_S = 0.005  # landed() polls the copies' events this long on the caller's loop, then leaves it to a thread


@dataclass(frozen=True)
class GroupRead:
    """One pull by every rank of a worker (WorkerAgents.read)."""

    future: concurrent.futures.Future  # every rank's pieces ended: None, or the first failure
    gpu_done: tuple[torch.cuda.Event, ...] | None  # TP=1, every piece a cuda_ipc copy queued: their events
    deadline: float  # time.monotonic() by which the pull must have ended

    async def landed(self) -> None:
        """Wait until the blocks hold the pulled KV; raise the pull's failure. With `gpu_done`, the copies'
        completion is the pull's (as for TransferHandle.done()): once queued they read the peer's mapped memory
        whatever the agent hears of the peer later. Their events are polled here, which spares the hop through the
        agent's loop thread (~0.3 ms of a 1.4 ms pull on H200: docs/benchmark-log.md); a copy still running at the
        deadline is left to the agent, which reports the timeout once its copies have settled (copies that ended
        while it settled them have landed all the same)."""
        if self.gpu_done is not None:
            try:
                for event in self.gpu_done:
                    await event_done(event, self.deadline, spin_s=SPIN_S)
                return
            except TransferTimeout:
                pass
        try:
            await asyncio.wrap_future(self.future)
        except Exception:
            if self.gpu_done is None or not all(event.query() for event in self.gpu_done):
                raise


def rank_agent_name(worker: str, rank: int, tp_size: int) -> str:
    return worker if tp_size == 1 else f"{worker}.rank{rank}"


class RankAgent:
    """One rank's agent and the peer groups it pulls from (the object behind a follower's rank service, and
    rank 0's local part). Thread-safe as KVAgent is; `add_group`/`remove_group` run one at a time per peer."""

    def __init__(self, agent: KVAgent, rank: int, clock: Any = None) -> None:
        self.agent, self.rank = agent, rank
        self.clock = clock  # a follower's engine.runner.tp_follower.LaunchClock (None on rank 0)
        self._groups: dict[str, GroupMetadata] = {}

    def metadata(self) -> bytes:
        return self.agent.metadata().to_bytes()

    def add_group(self, data: bytes, steps: StepTimes | None = None) -> str:
        """Connect to the ranks of peer worker `data` (GroupMetadata) this rank pulls from; `steps`: each
        connection's steps go there (None: not timed)."""
        group = GroupMetadata.from_bytes(data)
        own = self.agent.cache_info
        for rank, _ in group.pieces_for(own.head_range, spread=self.rank):
            if rank.name not in self.agent.remotes():
                self.agent.add_remote(rank, steps)
        self._groups[group.name] = group
        return group.name

    def remove_group(self, name: str) -> bool:
        group = self._groups.pop(name, None)
        if group is None:
            return False
        for rank in group.ranks:
            self.agent.remove_remote(rank.name)
        return True

    def start_read(self, peer: str, remote_ids: Sequence[int], local_ids: Sequence[int],
                   timeout: float | None, ready: torch.cuda.Event | None = None) -> list[TransferHandle]:
        group = self._groups.get(peer)
        if group is None:
            raise BadDescriptor(f"agent {self.agent.name!r} is not connected to worker {peer!r}")
        return read_from_group(self.agent, group, remote_ids, local_ids, timeout=timeout, spread=self.rank,
                               ready=ready)

    def read_group(self, peer: str, remote_ids: Sequence[int], local_ids: Sequence[int],
                   timeout: float | None, after_launches: int | None = None) -> None:
        """Blocking: pull this rank's heads; raises the first piece's failure once every piece has ended. With
        `after_launches` (rank 0's launch count at the booking), first wait until this follower has launched as
        much, so its pull is queued after every step that may still name the booked blocks."""
        if after_launches is not None and self.clock is not None:
            if not self.clock.wait_for(after_launches, CALL_TIMEOUT_S):
                raise TransferTimeout(f"rank {self.rank} launched {self.clock.count} of rank 0's {after_launches} "
                                      f"launches within {CALL_TIMEOUT_S:g} s")
        _first_failure([h.future for h in self.start_read(peer, remote_ids, local_ids, timeout)])

    def set_faults(self, kv: Mapping | None) -> None:
        self.agent.set_faults(kv)

    def metrics(self) -> dict:
        return self.agent.metrics()

    def close(self) -> None:
        self.agent.close()


@dataclass(frozen=True)
class RankAgents:
    """The rank-service factory (engine.runner.rank_service) that starts a RankAgent in each TP follower."""

    worker: str
    tp_size: int
    config: AgentConfig

    def prepare(self, device: str) -> str:
        dev = torch.device(device)
        return f"cuda:{put_first(dev.index or 0)}" if dev.type == "cuda" else device

    def start(self, rank: int, kv_cache: torch.Tensor, kv_spec: KVCacheSpec, kv_head_range: KVHeadRange,
              clock: Any = None) -> RankAgent:
        name = rank_agent_name(self.worker, rank, self.tp_size)
        return RankAgent(start_agent(name, self.config, kv_cache, kv_spec, kv_head_range), rank, clock)


class WorkerAgents:
    """Rank 0's handle on every rank's agent of one worker. `engine` is the worker's LLMEngine, built with
    `rank_service=RankAgents(...)` when its TP size is above 1."""

    def __init__(self, name: str, config: AgentConfig, engine: Any,
                 ahead: concurrent.futures.Future | None = None) -> None:
        """`ahead`: rank 0's agent being made (worker_setup.begin_agent, named rank_agent_name(name, 0, tp_size));
        None: made here."""
        self.name, self._engine = name, engine
        self._timeout_s = config.timeout_s
        self.tp_size = engine.config.tensor_parallel_size
        agent = start_agent(rank_agent_name(name, 0, self.tp_size), config, engine.kv_cache, engine.kv_spec,
                            engine.kv_head_range, ahead)
        self.start_steps = StepTimes()  # rank 0's agent's start, then the wait for the followers' metadata
        self.start_steps.extend(agent.start_steps)
        self.local = RankAgent(agent, 0)
        try:
            with self.start_steps.step("followers"):
                ranks = [agent.metadata()] + [AgentMetadata.from_bytes(f.result(CALL_TIMEOUT_S))
                                              for f in self._followers("metadata")]
            self.group = GroupMetadata(name, tuple(ranks))
        except BaseException:
            agent.close()
            raise

    def metadata(self) -> bytes:
        return self.group.to_bytes()

    def rename(self, name: str) -> None:
        """Peers know this worker as `name` from now on (a warm spare taking over a slot); its ranks' agents keep
        their own names, which peers reach through the group."""
        self.name = name
        self.group = GroupMetadata(name, self.group.ranks)

    def add_peer(self, data: bytes, steps: StepTimes | None = None) -> str:
        """Blocking: every rank connects to the ranks of peer worker `data` (GroupMetadata) it pulls from.
        `steps`: rank 0's steps go there, then the wait for the followers' (None: not timed)."""
        followers = self._followers("add_group", data)  # they connect while rank 0 does
        local = self._local(self.local.add_group, data, steps)
        with maybe_step(steps if followers else None, "followers"):
            _first_failure([local, *followers], CALL_TIMEOUT_S)
        return GroupMetadata.from_bytes(data).name

    def remove_peer(self, name: str) -> bool:
        """Blocking: every rank forgets worker `name`'s ranks (pulls in flight from them fail with PeerLost)."""
        found = self.local.remove_group(name)
        _first_failure(self._followers("remove_group", name), CALL_TIMEOUT_S)
        return found

    def replace_peer(self, name: str, data: bytes, steps: StepTimes | None = None) -> str:
        """Blocking: forget worker `name`'s ranks (a dead incarnation), then connect to `data`'s (`steps`: as
        add_peer's, after the removal's)."""
        with maybe_step(steps, "remove"):
            self.remove_peer(name)
        return self.add_peer(data, steps)

    def read(self, peer: str, remote_ids: Sequence[int], local_ids: Sequence[int],
             timeout: float | None = None, ready: torch.cuda.Event | None = None,
             after_launches: int | None = None) -> GroupRead:
        """Every rank pulls its heads of `remote_ids` from worker `peer` into `local_ids` (the same block ids on
        every rank): rank 0 after `ready` (an event on its device; None: after what its stream has queued now), each
        follower once it has launched `after_launches` of rank 0's launches (None: at once) and after what its
        stream has queued then. Its future resolves when every rank's pull has ended: None, or the first failure."""
        deadline = time.monotonic() + (timeout or self._timeout_s)
        handles = self.local.start_read(peer, remote_ids, local_ids, timeout, ready)
        events = tuple(h.gpu_done for h in handles)
        futures = [h.future for h in handles]
        futures += self._followers("read_group", peer, list(remote_ids), list(local_ids), timeout, after_launches)
        done: concurrent.futures.Future = concurrent.futures.Future()

        def settle(_: concurrent.futures.Future) -> None:
            if all(f.done() for f in futures) and not done.done():
                errors = [e for e in map(_error, futures) if e is not None]
                if errors:
                    done.set_exception(errors[0])
                else:
                    done.set_result(None)
        for f in futures:
            f.add_done_callback(settle)
        local_only = self.tp_size == 1 and bool(events) and all(e is not None for e in events)
        return GroupRead(done, events if local_only else None, deadline)

    def set_faults(self, kv: Mapping | None) -> None:
        self.local.set_faults(kv)
        _first_failure(self._followers("set_faults", kv), CALL_TIMEOUT_S)

    def metrics(self) -> list[dict]:
        """Every rank's transfer metrics (rank order)."""
        return [self.local.metrics(), *(f.result(CALL_TIMEOUT_S) for f in self._followers("metrics"))]

    def close(self) -> None:
        self.local.close()  # the followers' agents close when their processes stop (engine close)

    def _followers(self, method: str, *args: Any) -> list[concurrent.futures.Future]:
        return [self._engine.rank_call(r, method, *args) for r in range(1, self.tp_size)]

    @staticmethod
    def _local(fn, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)
        return future


def _first_failure(futures: list[concurrent.futures.Future], timeout: float | None = None) -> None:
    """Wait for every future; raise the first one's exception (in list order), if any."""
    concurrent.futures.wait(futures, timeout)
    for f in futures:
        if not f.done():
            raise TimeoutError(f"a rank did not answer within {timeout} s")
        if (error := _error(f)) is not None:
            raise error


def _error(f: concurrent.futures.Future) -> BaseException | None:
    """A done future's exception (a cancelled one's is CancelledError), or None."""
    return concurrent.futures.CancelledError() if f.cancelled() else f.exception()
