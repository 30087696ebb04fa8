"""LLMEngine: one model on one device, stepped by its owner. The API the prefill and decode workers build on.

step() = schedule, run, update. Steps overlap (EngineConfig.async_scheduling, on CUDA by default): step() queues the
next step on the device before it waits for the current one's tokens, so the host's scheduling and bookkeeping hide
behind the device's work; a step's tokens are then returned by the step() call after the one that launched it.
Decodes, prompt chunks, requests started between steps with their next token known (add_prefilled_request) and
newly admitted prompts all join the step queued next (Scheduler.schedule_after); only prefill-only requests, fork
groups, prompt logprobs, per-layer hooks and preemption make a step wait for the one before to be read. On the CPU
a step computes inside its launch, so overlap would only hand its tokens out a step later: off unless asked for.
Besides plain requests it offers the two disaggregation entry points:
- prefill side: add_request(..., prefill_only=True) computes the prompt, samples the first token, then keeps the
  request's blocks pinned (reported in StepOutput.pinned_block_ids) until release() or the pin lease expires;
- decode side: reserve_blocks() hands out blocks for a prompt's KV to be written into by the transfer layer, and
  add_prefilled_request() starts decoding from the first token without recomputing the prompt.
Every entry point takes `prior_output_ids`: a request resumed after its worker died, whose first k outputs were
already delivered. Their KV is computed (or transferred) with the prompt's, the next token sampled is output k, and
max_tokens counts them; outputs carry only new tokens (see engine.request).
Ownership: every block belongs to exactly one of: the free pool, the prefix cache, a running request, a pinned
request or a reservation; check_integrity() asserts it. The engine is not thread-safe: one loop owns it.
Tensor parallelism (EngineConfig.tensor_parallel_size = N > 1): this engine is rank 0 and owns N - 1 follower
processes (engine.runner.tp_leader) until close(); `kv_spec` and `kv_head_range` describe rank 0's cache, and
`kv_shards` every rank's (each holds its own KV heads). N = 1 runs no process and no collective.
Layout: this module holds the engine's construction and add_request/abort; LLMEngine's other methods come from
mixins, one module each: step() and what it runs (engine.engine_steps), the disaggregation entry points
(reservations, handoff starts, pins: engine.handoff_blocks), structured outputs and the requests held for their
grammar (engine.grammar_holding), the device-host KV copies (engine.host_kv), load()/check_integrity()
(engine.engine_report) and the steps of a prefill lane, prompts beside the decode steps on their own SMs
(engine.lane_steps; EngineConfig.sm_split_decode_sms).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from engine.core.block_manager import BlockManager
from engine.core.copy_cost import CopyCost
from engine.core.request import Request, validate_request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.step_budget import StepBudget
from engine.engine_config import EngineConfig
from engine.engine_report import EngineReport
from engine.engine_steps import EngineSteps, LayerHook
from engine.grammar_holding import GrammarHolding, _Held
from engine.handoff_blocks import HandoffBlocks, LaunchFence
from engine.host_kv import HostKV
from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec
from engine.kv_quant import load_kv_scales
from engine.lane_steps import LaneSteps
from engine.load import PhaseClock
from engine.model.model_config import ModelConfig
from engine.model.tp_layout import TPLayout
from engine.prefix_exchange import PrefixExchange
from engine.runner.deferred_graphs import DeferredGraphs
from engine.runner.kv_cache import cache_spec
from engine.runner.model_runner import LaunchedStep, ModelRunner
from engine.runner.rank_setup import build_rank
from engine.runner.swap_store import build_swap
from engine.sampling.sampler import Sampler
from engine.step_rates import measure_step_rates
from engine.text.tokenizer import Tokenizer
from engine.tiny import resolve_model_path

if TYPE_CHECKING:
    from concurrent.futures import Future

    from engine.runner.rank_service import RankServiceFactory
    from engine.sampling.grammar import GrammarManager
    from engine.sampling.grammar_loader import GrammarLoader


__all__ = ["LLMEngine", "LaunchFence", "LayerHook", "STEP_BUDGET_FLOOR"]  # LaunchFence: re-exported

GRAMMAR_WAIT_S = 30.0  # how long the step-rate probe waits for a structured-output build running beside the load
STEP_BUDGET_FLOOR = 64  # prompt tokens a decoding step may always carry (engine.core.step_budget)


class LLMEngine(EngineSteps, HandoffBlocks, PrefixExchange, GrammarHolding, HostKV, EngineReport, LaneSteps):
    def __init__(self, config: EngineConfig, rank_service: RankServiceFactory | None = None,
                 grammar_at_start: bool = False) -> None:
        """`rank_service`: with TP, an object to start in every follower beside its cache shard (reached with
        `rank_call`; engine.runner.rank_service); ignored at TP=1, where the caller holds rank 0's cache itself.
        `grammar_at_start`: the structured-output machinery is built on its own thread from now on, beside the
        load (start_grammar_load; a pool worker's choice), not with the first structured request."""
        clock = PhaseClock()  # start-up phases: config, then build_rank's (weights, kv_cache, *graphs), warmup
        path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_folder(path)
        # the tokenizer (a 128k vocabulary's tokenizer.json: a few hundred ms) is read beside the weights' load
        reading = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        tokenizer = reading.submit(Tokenizer.from_folder, path)
        reading.shutdown(wait=False)
        mc = self.model_config
        dtype = mc.torch_dtype if config.dtype == "auto" else config.dtype
        max_model_len = config.max_model_len or mc.max_position_embeddings
        if max_model_len > mc.max_position_embeddings:
            raise ValueError(f"EngineConfig.max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings} ({path}/config.json)")
        self.config = replace(config, dtype=dtype, max_model_len=max_model_len)
        n = config.tensor_parallel_size
        TPLayout.check(mc, n)
        scales = load_kv_scales(None if config.load_format == "dummy" else path, mc.num_layers)
        self.kv_shards: tuple[tuple[KVCacheSpec, KVHeadRange], ...] = tuple(
            (cache_spec(mc, TPLayout(mc, r, n).kv_heads, self.config, scales), TPLayout(mc, r, n).kv_head_range)
            for r in range(n))  # per rank: cache, heads
        self.followers = None
        if n > 1:
            from engine.runner.tp_leader import TPFollowers, rank_devices
            self.device = rank_devices(self.config)[0]
            self.followers = TPFollowers(self.config, path, mc, rank_service)
        else:
            self.device = torch.device(config.device)
        self.grammar_loader: GrammarLoader | None = None  # the machinery built on its own thread (start_grammar_load)
        if grammar_at_start:  # its hold of the GIL (~1 s for a 128k vocabulary) falls in the load, not after it
            self.start_grammar_load(tokenizer=tokenizer.result)
        # overlapped steps (async_scheduling; None: where the device runs asynchronously, i.e. CUDA)
        self.overlap = config.async_scheduling if config.async_scheduling is not None else self.device.type == "cuda"
        clock.lap("config")
        try:
            rank = build_rank(mc, path, self.config, self.device, self.followers and self.followers.tp,
                              self.followers.agree_blocks if self.followers else int, clock)
            if self.followers:
                self.followers.wait_started()
        except BaseException:
            self.close()
            raise
        self.tokenizer = tokenizer.result()
        self.model, self.uses_kernels, self.kv_cache = rank.model, rank.uses_kernels, rank.kv_cache
        self.kv_spec, self.kv_head_range, self.num_kv_blocks = rank.kv_spec, rank.kv_head_range, rank.num_kv_blocks
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        # the host tier under the prefix cache (kv_host_cache_bytes; None: none); it and the swap space copy KV
        # where that beats computing it, by the rates in copy_cost (the engine's prompt steps time it below)
        self.copy_cost = CopyCost()
        self._start_host_tier(config, self.copy_cost)  # built beside the start; joins at a step (engine.host_kv)
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        # preempted requests' KV on the host (preemption_mode swap / auto; None: recomputed)
        self.swap_space, self.swap_store = build_swap(config.preemption_mode, config.swap_space_bytes,
                                                      self.kv_cache, self.copy_cost) or (None, None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   max_prefill_chunk=config.max_prefill_chunk,
                                   head_bypass_steps=config.head_bypass_steps, swap=self.swap_space)
        # joined now on every device: on an H200 (77ee757) pinning 48 GiB beside the warm-up slowed both (ready after
        # 71.0 s against 46.7 s when the start waited for it); a build beside serving is left for a measured design
        self.wait_for_host_tier()
        sampler = Sampler(self.device, config.seed, mc.eos_token_ids, self.scheduler.requests,
                          cpu_kernel=config.kernels == "auto")
        if self.followers is None:
            self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, sampler, rank.graphs,
                                      rank.prefill_graphs, rank.mixed_graphs)
        else:
            from engine.runner.tp_leader import TPModelRunner
            self.runner = TPModelRunner(self.model, self.kv_cache, config.block_size, sampler, rank.graphs,
                                        rank.prefill_graphs, rank.mixed_graphs, followers=self.followers)
        self.lane = self._prefill_lane(config)  # prompts beside the decode steps (sm_split_decode_sms; None: off)
        # graphs left for after start (graph_capture "deferred"; None: none), captured between steps
        self.deferred_graphs = DeferredGraphs([
            self.runner.graphs, *(self.lane.graph_sets if self.lane else ()), self.runner.prefill_graphs,
            self.runner.mixed_graphs]) if self.followers is None and rank.graphs is not None else None
        self._reserved: set[str] = set()
        self._reserved_hits: dict[str, int] = {}  # reservations that began with prefix-cache hits -> how many blocks
        self.num_handoff_hit_blocks = 0  # blocks of requests started by add_prefilled_request the prefix cache held
        self._leases: set[str] = set()  # prefix blocks lent to or fetched from another worker (engine.prefix_exchange)
        self.num_lent_blocks = self.num_lent_host_blocks = self.num_fetched_blocks = 0
        self.grammar: GrammarManager | None = None  # made with the first structured request (engine.grammar)
        self._held: dict[str, _Held] = {}  # structured requests waiting for the loader, in arrival order
        self._in_flight: LaunchedStep | None = None  # a decode step on the device whose tokens are not applied
        self.num_steps = 0  # step() calls since start, and the host time they took (for load())
        self.step_time_last_s = 0.0
        self.step_time_total_s = 0.0
        self.step_delay_s = 0.0  # injected: each step sleeps this long first (drills: a throttled worker)
        self.num_expired_pins = 0  # pinned requests their lease freed: nobody released nor aborted them in time
        self.step_budget = None if config.decode_step_target_s is None else StepBudget(
            config.decode_step_target_s, min(STEP_BUDGET_FLOOR, config.max_num_batched_tokens),
            config.max_num_batched_tokens)
        self._applied: tuple[int, int] | None = None  # (decode rows, prompt tokens) of the step applied last
        if self.uses_kernels and config.warmup and self.device.type == "cuda":  # no compiles on the CPU
            from engine.runner.warmup import warm_up  # Triton (0.9 s to import): a CPU engine never needs it

            warm_up(self)
            if self.host_tier is not None:  # warm-up's blocks are no prompt's
                self.host_tier.clear()
            clock.lap("warmup")
        if self.step_budget is not None and config.warmup:  # its figures from the first request on
            if self.grammar_loader is not None:  # its build holds the GIL: the probe would time a disturbed engine
                self.grammar_loader.wait(GRAMMAR_WAIT_S)
            measure_step_rates(self)
            clock.lap("step_rates")
        self.startup_s: tuple[tuple[str, float], ...] = tuple(clock.phases)  # seconds per start-up phase

    # ---- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prefill_only: bool = False, prior_output_ids: Sequence[int] = (), priority: int = 0,
                    fork_params: Sequence[SamplingParams] | None = None) -> None:
        """Queue a request. With `prior_output_ids` it resumes one whose first k outputs were already delivered:
        the next token sampled (the first output returned) is output k. Waiting requests start in `priority` order
        (lower first; arrival order within one priority); running ones are never displaced by it. `fork_params`
        (prefill_only only; () for a group of one) makes it a group prefill: the first tokens of n - 1 more
        choices are sampled from the same logits (StepOutput.fork_first); it stays pinned for fork_reservation()."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id!r}: priority must be an int, got {priority!r}")
        if fork_params is not None and not prefill_only:
            raise ValueError(f"request {request_id!r}: fork_params needs prefill_only")
        prior = self._validate(request_id, prompt_token_ids, params, prior_output_ids)
        for p in fork_params or ():
            self._validate(request_id, prompt_token_ids, p, prior_output_ids)
        if request_id in self._held or request_id in self.scheduler.requests or self.block_manager.has_table(
                request_id):  # checked here for a held request too (Scheduler.add checks the others again)
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._grammar_pending(params):  # held until the loader is done; the engine steps on meanwhile
            req = self._request(request_id, prompt_token_ids, params, prefill_only, prior, priority)
            req.fork_params = None if fork_params is None else tuple(fork_params)
            self._held[request_id] = _Held(req)
            return
        grammar = self._grammar_row(request_id, params, prior)
        req = self._request(request_id, prompt_token_ids, params, prefill_only, prior, priority)
        req.fork_params = None if fork_params is None else tuple(fork_params)
        self.scheduler.add(req)
        if grammar is not None:
            self.grammar.attach(request_id, grammar, req.incarnation)

    def abort(self, request_id: str) -> bool:
        """End a request in any state (waiting, running, pinned) or drop a reservation; frees its blocks."""
        held = self._held.pop(request_id, None)
        if self.grammar is not None:
            self.grammar.drop(request_id)
        if self.lane is not None and request_id in self.scheduler.held:
            self.lane.wait()  # its blocks are written by the lane until then
        if request_id in self._reserved:
            self._reserved.discard(request_id)
            self._reserved_hits.pop(request_id, None)
            self.block_manager.free(request_id)
            return True
        return held is not None or self.scheduler.finish(request_id, "abort")

    def rank_call(self, rank: int, method: str, *args) -> Future:
        """Call `method` of follower `rank`'s rank service (LLMEngine(rank_service=...)); thread-safe, unlike the
        rest of the engine: it touches no engine state, only the call pipes."""
        if self.followers is None or self.followers.calls is None:
            raise RuntimeError("this engine has no tensor-parallel rank services")
        if not 1 <= rank < self.config.tensor_parallel_size:
            raise ValueError(f"rank {rank} is not a follower rank of TP size {self.config.tensor_parallel_size}")
        return self.followers.calls.call(rank, method, *args)

    def close(self) -> None:
        """Stop the prefill lane's thread and the tensor-parallel followers; the engine cannot step afterwards."""
        if getattr(self, "lane", None) is not None:
            self.lane.close()
        if self.followers is not None:
            if getattr(self, "runner", None) is not None:  # CUDA graphs that captured NCCL kernels go before the
                # communicator: tearing it down under them hangs (pytorch#115388); a pool worker froze them at
                # start-up (engine.gc_pauses.freeze_startup_objects)
                self.runner.graphs = self.runner.prefill_graphs = self.runner.mixed_graphs = None
                gc.unfreeze()
                gc.collect()
            self.followers.close()

    # ---- internals
    def _request(self, request_id: str, prompt: list[int], params: SamplingParams, prefill_only: bool,
                 prior: tuple[int, ...], priority: int = 0) -> Request:
        return Request(request_id, list(prompt), params, self.model_config.eos_token_ids,
                       self.config.max_model_len, prefill_only=prefill_only, prior_output_ids=prior,
                       priority=priority)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams,
                  prior_output_ids: Sequence[int]) -> tuple[int, ...]:
        return validate_request(request_id, prompt, params, prior_output_ids, self.model_config.vocab_size,
                                self.config.max_model_len, self.config.block_size, self.num_kv_blocks)
