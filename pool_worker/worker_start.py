"""The worker's start-up (`WorkerStart.start`, a mixin of pool_worker.worker.Worker): in the worker's own process,
the imports the coordinator never needs (torch, the engine, the transfer agents when the worker moves KV), then the
engine (weights, KV cache, CUDA graphs; the structured-output tables on a thread of their own beside it), rank 0's
KV agent made beside the engine's load, the output stream, the two duties on one AsyncEngine loop, the
garbage-collector freeze, and the WorkerInfo the coordinator routes by. Seconds per phase go into WorkerInfo as
pool_worker.start_phases names them; the `agent` phase's steps into one log line (a warning: a Ray worker's root
logger has no handler, so only warnings reach the server's log).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import replace

from decode_pool.decodes import Decodes
from decode_pool.worker_stream import WorkerStream
from engine.async_engine import AsyncEngine, exit_process_on_failure
from engine.gc_pauses import freeze_startup_objects
from engine.load import WorkerInfo
from kvtransfer.step_times import StepTimes
from pool_worker.prefix_share import PrefixShare
from pool_worker.start_phases import imports_done
from prefill_pool.prefills import Prefills

log = logging.getLogger("pdserve")


class WorkerStart:
    """Worker's start(); the attributes it sets are Worker's (its __init__ names them)."""

    async def start(self) -> WorkerInfo:
        # torch, the engine and the agents load here, in the worker's own process: the coordinator, which only
        # imports this class to start actors from it, then needs none of them
        import torch

        from engine.llm_engine import LLMEngine

        torch.set_num_threads(self._num_threads)
        transfers = self._agent_config is not None
        if transfers:  # a collocated worker runs no KV agent: it never imports the transfer modules (ucxx)
            from kvtransfer.worker_agents import RankAgents, WorkerAgents, rank_agent_name
            from kvtransfer.worker_setup import begin_agent, discard_agent, prepare_process

            if self._agent_config.address is None:  # the interface Ray's node uses
                import ray  # (a single-host server's: the loopback, coordinator.backend.ray_network)

                address = os.environ.get("KVTRANSFER_ADDRESS") or ray.util.get_node_ip_address()
                self._agent_config = replace(self._agent_config, address=address)
            prepare_process(self._engine_config.device, self._agent_config)  # before CUDA starts
        self._phases.append(imports_done(self._imports_began))
        tp = self._engine_config.tensor_parallel_size
        # rank 0's KV agent (UCX's context: ~0.8 s on a GPU host) is made beside the engine's load, not after it
        ahead = begin_agent(rank_agent_name(self.name, 0, tp), self._agent_config) if transfers else None
        rank_agents = RankAgents(self.name, tp, self._agent_config) if transfers and tp > 1 else None
        # weights, KV cache, CUDA graphs; the structured-output tables beside them, on a thread of their own
        try:
            engine = LLMEngine(self._engine_config, rank_agents, grammar_at_start=True)
        except BaseException:
            if ahead is not None:
                discard_agent(ahead)
            raise
        started = time.monotonic()
        self._phases += [(f"engine_{k}", v) for k, v in engine.startup_s]
        steps = StepTimes()  # the `agent` phase's, logged once it is done
        if transfers:
            with steps.step("agent_wait"):  # what of the agent's start the engine's load did not cover
                ahead.exception()
            self.agents = WorkerAgents(self.name, self._agent_config, engine, ahead)
            steps.extend(self.agents.start_steps)
        if self._use_stream:
            with steps.step("stream"):
                import ray

                self._stream = WorkerStream(ray.util.get_node_ip_address(), self._command)
        timeout_s = self._agent_config.timeout_s if self._agent_config else 0.0
        with steps.step("duties"):
            self.prefills = Prefills(self.name, self.agents, engine.config.block_size, engine.model_config.num_layers,
                                     timeout_s, self._reported)
            pushes = self.prefills.pushes
            self.loop = AsyncEngine(engine, self._on_outputs, pushes.hook if pushes else None, self._step_hook,
                                    pushes.pending if pushes else None)
            self.prefills.loop = self.loop
            self.decodes = Decodes(self.name, self.loop, self.agents, self._stream, self._admission_timeout_s,
                                   self.load, self._reported)
            if self.agents is not None:
                self.share = PrefixShare(self.name, self.loop, self.agents, timeout_s)
            self._tasks.append(asyncio.get_running_loop().create_task(self.loop.run()))
            exit_process_on_failure(self._tasks[0], self.name)
        with steps.step("gc_freeze"):  # a full collection over everything start-up made, then the freeze
            freeze_startup_objects()
        self._gc.install()
        outputs_at = None
        if self._stream is not None:
            outputs_at = (*self._stream.address, self._stream.token)
            self._tasks.append(asyncio.get_running_loop().create_task(self.decodes.keep_load_fresh()))
        self._phases.append(("agent", round(time.monotonic() - started, 3)))
        log.warning("worker %s: agent phase %.3f s, its steps: %s", self.name, self._phases[-1][1], steps)
        self._info = WorkerInfo(self.name, self.role, engine.num_kv_blocks, engine.config.block_size,
                                engine.config.max_model_len, engine.model_config.vocab_size,
                                self.agents.metadata() if self.agents else None, tuple(self._phases),
                                pid=os.getpid(), host=socket.gethostname(), outputs_at=outputs_at)
        # routable from here on: if the grammar tables are still being built (off the engine thread, since the
        # engine's start), structured requests that arrive first wait in the engine, the others step on; the
        # build's end wakes the engine thread
        engine.start_grammar_load(self._wake_engine)
        return self._info
