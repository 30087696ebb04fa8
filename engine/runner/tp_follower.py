"""A tensor-parallel follower: a child process (ranks 1..N-1) that holds one model shard and its KV cache and runs
exactly the steps rank 0 plans, nothing else (no scheduler, no sampler).

Protocol over its pipe from rank 0 (engine.runner.tp_leader): ("ready", affordable blocks) up, ("start", blocks)
down, ("started", None) up, then a stream of ("step", StepPlan), ("copy", [(src, dst)]), ("warmup", (max_num_seqs,
max_blocks_per_seq)) and ("close", None) down.
Any failure goes up as ("error", traceback) before the process exits (a ConfigError, such as a broken tensor of its
slice, as ("config_error", message), which rank 0 raises as a ConfigError); a closed pipe (rank 0 gone) ends it.
With a rank service (engine.runner.rank_service), its object is started once the cache exists, before "started",
and answers rank 0's calls on a second pipe.
Invariant: a follower's block tables are rank 0's, because it runs rank 0's SchedulerOutput as received; its
collectives come in the same order as rank 0's because it makes the same graph/eager and logits decisions
(`follow` mirrors ModelRunner.launch).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config_error import ConfigError
from engine.core.scheduler import SchedulerOutput
from engine.engine_config import EngineConfig
from engine.gc_pauses import freeze_startup_objects
from engine.model.model_config import ModelConfig
from engine.model.parallel import TPGroup
from engine.model.symmetric_all_reduce import open_one_shot
from engine.runner.kv_cache import TORCH_DTYPES
from engine.runner.model_runner import ModelRunner
from engine.runner.rank_service import RankServiceFactory, serve_calls
from engine.runner.step_extras import token_offsets
from engine.runner.step_inputs import build_step_inputs
from engine.runner.warmup import decode_variants

log = logging.getLogger(__name__)
LAUNCHES = ("step", "copy", "warmup")  # the messages that queue device work on a follower, counted on both sides


class LaunchClock:
    """How many of rank 0's launch messages this follower has launched (its main thread ticks; a call thread may
    wait). Rank 0's count at a booking is where the follower's own fence for that booking lies."""

    def __init__(self) -> None:
        self.count = 0
        self._cond = threading.Condition()

    def tick(self) -> None:
        with self._cond:
            self.count += 1
            self._cond.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.count >= count, timeout)


COLLECTIVE_TIMEOUT_S = 300  # a collective waits at most this long for its peers (start-up included)


@dataclass(frozen=True)
class StepPlan:
    """What a follower needs to run rank 0's step (small and picklable)."""

    sched: SchedulerOutput
    ids_from_leader: bool      # a step queued after one in flight: rank 0 broadcasts the input ids
    eager: bool                # rank 0 runs this step eagerly (step extras or a per-layer hook)
    prompt_rows: dict[str, int]  # request id -> rows of prompt logprobs rank 0 computes (one logits call each)


@dataclass(frozen=True)
class GroupAddress:
    """Where a TP group's ranks meet: rank 0's TCP store on this host, and the group's name (unique on the host:
    the key prefix in the store and the one-shot kernel's registration)."""

    host: str
    port: int
    name: str


def host_store(size: int, name_prefix: str = "pdserve-tp") -> tuple[dist.TCPStore, GroupAddress]:
    """Rank 0's store server on a free loopback port, and the address its followers connect to. A TCP store lives
    exactly as long as rank 0: a file store's file vanished under NCCL's heartbeat monitor when a follower
    exited, and the monitor then blocked its process group's teardown for the store timeout (5 min)."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    server = dist.TCPStore("127.0.0.1", 0, size, True, timeout, wait_for_workers=False)
    return server, GroupAddress("127.0.0.1", server.port, f"{name_prefix}-{os.getpid()}-{server.port}")


def open_group(address: GroupAddress, rank: int, size: int, device: torch.device, config: EngineConfig,
               store: dist.Store | None = None) -> TPGroup:
    """The TP process group: gloo on the CPU, NCCL on CUDA (a standalone group object), with the one-shot
    all-reduce for small sums on CUDA when config.tp_all_reduce asks for it ("auto": NCCL alone where symmetric
    memory cannot be set up; every rank agrees on the outcome). `store`: rank 0's server (from host_store); other
    ranks connect to `address`. Collective."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if store is None:
        store = dist.TCPStore(address.host, address.port, size, False, timeout)
    store = dist.PrefixStore(address.name + "/", store)
    if device.type != "cuda":
        return TPGroup(rank, size, dist.ProcessGroupGloo(store, rank, size, timeout))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    if config.tp_all_reduce == "nccl":
        return TPGroup(rank, size, pg)
    try:
        one_shot = open_one_shot(pg, store, rank, size, device, TORCH_DTYPES[config.dtype], address.name)
    except RuntimeError as e:
        if config.tp_all_reduce == "one_shot":
            raise
        log.warning("%s; tp_all_reduce 'auto' sums with NCCL alone", e)  # every rank: each says its own reason
        return TPGroup(rank, size, pg)
    return TPGroup(rank, size, pg, one_shot)


def follow(runner: ModelRunner, tp: TPGroup, plan: StepPlan) -> None:
    """Run rank 0's step on this shard: the same forward and logits calls (hence collectives), results dropped."""
    sched = plan.sched
    step = build_step_inputs(sched, runner.block_size, runner.device, runner.model.config.sliding_window)
    input_ids = step.input_ids
    if plan.ids_from_leader:
        input_ids = tp.broadcast(torch.empty_like(input_ids))  # rank 0's, with the tokens of the step before
    fits = runner._graph_fits(runner.graphs, input_ids.shape[0], step.decode_only, len(step.sampling), None)
    if not plan.eager and fits:
        runner.graphs.run(input_ids, step.positions, step.meta)
        return
    hidden = runner.forward(input_ids, step, None, plan.eager)  # rank 0's choice of prefill graph, made alike
    offsets = token_offsets(sched)
    for c in sched.chunks:  # engine.step_extras.compute_prompt_logprobs's calls, in its order
        n = plan.prompt_rows.get(c.request_id)
        if n:
            runner.model.compute_logits(hidden[offsets[c.request_id]:offsets[c.request_id] + n])
    if step.sampling:
        runner.model.compute_logits(hidden[step.sample_index])


def follower_main(rank: int, size: int, address: GroupAddress, device: str, config: EngineConfig, path: str,
                  mc: ModelConfig, conn, service: RankServiceFactory | None = None, calls_conn=None) -> None:
    """Entry point of a spawned follower process; `service` (with its pipe `calls_conn`): see rank_service."""
    from engine.runner.rank_setup import build_rank
    running, tp, state, runner = None, None, None, None
    try:
        if service is not None:
            device = service.prepare(device)  # before CUDA starts
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        else:  # ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        conn.send(("joining", None))  # rank 0 opens its side only then: a rank lost before this one is named
        tp = open_group(address, rank, size, dev, config)

        def agree(blocks: int) -> int:
            conn.send(("ready", blocks))
            kind, agreed = conn.recv()
            assert kind == "start", kind
            return agreed

        state = build_rank(mc, Path(path), config, dev, tp, agree)
        runner = ModelRunner(state.model, state.kv_cache, config.block_size, None, state.graphs,
                             state.prefill_graphs, state.mixed_graphs)
        clock = LaunchClock()
        if service is not None:
            running = service.start(rank, state.kv_cache, state.kv_spec, state.kv_head_range, clock)
            serve_calls(calls_conn, running)
        conn.send(("started", None))
        freeze_startup_objects()  # as rank 0's worker: no full collection over start-up's objects stalls a step
        with torch.inference_mode():
            while True:
                kind, arg = conn.recv()
                if kind == "step":
                    follow(runner, tp, arg)
                elif kind == "copy":
                    runner.copy_blocks(arg)
                elif kind == "warmup":  # engine.runner.warmup: the decode kernel's variants on this shard
                    decode_variants(runner.model, runner.kv_cache, *arg)
                elif kind == "close":
                    return
                if kind in LAUNCHES:
                    clock.tick()
    except EOFError:
        return  # rank 0 is gone
    except ConfigError as e:  # a broken checkpoint (a tensor of this rank's slice): rank 0 raises it as it is
        try:
            conn.send(("config_error", str(e)))
        finally:
            raise
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            raise
    finally:
        if running is not None and hasattr(running, "close"):
            running.close()
        if tp is not None:  # explicitly, while rank 0 tears its side down too (engine.runner.tp_leader._stop);
            state = runner = None  # CUDA graphs that captured NCCL kernels first (pytorch#115388)
            gc.unfreeze()
            gc.collect()
            tp.close()
