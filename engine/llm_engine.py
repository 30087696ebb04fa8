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
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine.core.block_manager import BlockManager
from engine.core.host_tier import HostTier
from engine.core.request import Request, RequestStatus, TokenLogprob, check_token_ids, validate_request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerOutput, StepOutput
from engine.core.step_budget import StepBudget
from engine.engine_config import EngineConfig
from engine.kv_heads import KVHeadRange
from engine.kv_layout import KVCacheSpec
from engine.kv_quant import load_kv_scales
from engine.load import EngineLoad, PhaseClock
from engine.model.model_config import ModelConfig
from engine.model.tp_layout import TPLayout
from engine.runner.host_tier_store import HostTierStore, auto_host_cache_bytes, build_host_tier_store
from engine.runner.kv_cache import cache_spec
from engine.runner.model_runner import LaunchedStep, ModelRunner
from engine.runner.rank_setup import build_rank
from engine.runner.step_extras import plan_extras, record_extras, with_extras
from engine.runner.swap_store import build_swap
from engine.sampling.sampler import Sampler
from engine.text.tokenizer import Tokenizer
from engine.tiny import resolve_model_path

if TYPE_CHECKING:
    from concurrent.futures import Future

    from engine.runner.rank_service import RankServiceFactory
    from engine.sampling.grammar import GrammarManager
    from engine.sampling.grammar_loader import GrammarLoader


LayerHook = Callable[[SchedulerOutput], Callable[[int], None] | None]  # see LLMEngine.step
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchFence:
    """Where a write from outside into blocks reserved now may start (LLMEngine.launch_fence)."""

    event: torch.cuda.Event | None  # rank 0: after every launch queued so far on its stream (None on the CPU)
    follower_launches: int | None   # TP: rank 0's launches sent to its followers so far (None without followers)

@dataclass
class _Held:
    """A structured request that arrived while its grammar's loader was building (LLMEngine.start_grammar_load):
    add_request's (`first` None: it holds nothing) or add_prefilled_request's (its first token; it keeps its booked
    blocks). Started, in arrival order, by the first step after the loader is done."""

    req: Request
    first: tuple[int, TokenLogprob | None] | None = None


STEP_BUDGET_FLOOR = 64  # prompt tokens a decoding step may always carry (engine.core.step_budget)

class LLMEngine:
    def __init__(self, config: EngineConfig, rank_service: RankServiceFactory | None = None) -> None:
        """`rank_service`: with TP, an object to start in every follower beside its cache shard (reached with
        `rank_call`; engine.runner.rank_service); ignored at TP=1, where the caller holds rank 0's cache itself."""
        clock = PhaseClock()  # start-up phases: config, then build_rank's (weights, kv_cache, *graphs), warmup
        path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_folder(path)
        self.tokenizer = Tokenizer.from_folder(path)
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
        self.model, self.uses_kernels, self.kv_cache = rank.model, rank.uses_kernels, rank.kv_cache
        self.kv_spec, self.kv_head_range, self.num_kv_blocks = rank.kv_spec, rank.kv_head_range, rank.num_kv_blocks
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        # the host tier under the prefix cache (kv_host_cache_bytes; None: none)
        self.host_tier, self.host_tier_store = self._host_tier(config)
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                          record_evictions=self.host_tier is not None)
        # preempted requests' KV on the host (preemption_mode swap / auto; None: recomputed)
        self.swap_space, self.swap_store = build_swap(config.preemption_mode, config.swap_space_bytes,
                                                      self.kv_cache) or (None, None)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   max_prefill_chunk=config.max_prefill_chunk,
                                   head_bypass_steps=config.head_bypass_steps, swap=self.swap_space,
                                   tier=self.host_tier)
        sampler = Sampler(self.device, config.seed, mc.eos_token_ids, self.scheduler.requests,
                          cpu_kernel=config.kernels == "auto")
        if self.followers is None:
            self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, sampler, rank.graphs,
                                      rank.prefill_graphs, rank.mixed_graphs)
        else:
            from engine.runner.tp_leader import TPModelRunner
            self.runner = TPModelRunner(self.model, self.kv_cache, config.block_size, sampler, rank.graphs,
                                        rank.prefill_graphs, rank.mixed_graphs, followers=self.followers)
        self._reserved: set[str] = set()
        self._reserved_hits: dict[str, int] = {}  # reservations that began with prefix-cache hits -> how many blocks
        self.num_handoff_hit_blocks = 0  # blocks of requests started by add_prefilled_request the prefix cache held
        self.grammar: GrammarManager | None = None  # made with the first structured request (engine.grammar)
        self.grammar_loader: GrammarLoader | None = None  # or on its own thread (start_grammar_load)
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
            self.grammar.attach(request_id, grammar)

    def abort(self, request_id: str) -> bool:
        """End a request in any state (waiting, running, pinned) or drop a reservation; frees its blocks."""
        held = self._held.pop(request_id, None)
        if request_id in self._reserved:
            self._reserved.discard(request_id)
            self._reserved_hits.pop(request_id, None)
            self.block_manager.free(request_id)
            return True
        return held is not None or self.scheduler.finish(request_id, "abort")

    def release(self, request_id: str) -> bool:
        """Free a pinned prefill-only request's blocks (its KV has been moved). False if it is not pinned."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status != RequestStatus.PINNED:
            return False
        return self.scheduler.finish(request_id, "stop")

    def reserve_blocks(self, request_id: str, num_tokens: int, leave_room: bool = False,
                       prefix_hashes: Sequence[bytes] = ()) -> list[int] | None:
        """Decode side: take blocks for `num_tokens` tokens of KV (the prompt's, plus the prior outputs' for a
        resumed request) to be written in from outside. None when the cache has no room now (try later). Abort the
        id to give them back. `leave_room`: room means more than free blocks: none while a preempted request waits
        to resume (its stream is paused: it comes first), and the running requests keep the blocks they need to
        cross their next block boundary (Scheduler.growth_headroom), as does this request for its first token, so
        the reservation makes no running stream the victim of a preemption (the joining request, the newest, would
        be the first: its KV moved here for nothing).
        `prefix_hashes`: the hashes of the KV's leading full blocks (engine.core.block_manager.prefix_block_hashes
        of its tokens but the last). The longest run of them the prefix cache holds starts the table, shared (ref
        counted, as a prompt's prefix hits are): their KV is here already, and only the blocks after them need
        writing (`reserved_hits` says how many lead the table)."""
        if request_id in self.scheduler.requests or request_id in self._reserved or request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already in use")
        bm = self.block_manager
        hits = bm.cached_blocks(prefix_hashes)[:max(bm.blocks_needed(num_tokens) - 1, 0)]  # one block is written
        if leave_room:
            s = self.scheduler
            own = bm.blocks_needed(num_tokens + 1) - bm.blocks_needed(num_tokens)
            new = bm.blocks_needed(num_tokens) - len(hits) + bm.num_unreferenced(hits)  # cached hits leave the pool
            if s.has_paused or bm.num_free_blocks < new + own + s.growth_headroom():
                return None
        if not bm.allocate(request_id, num_tokens, hits):
            return None
        self._offload_now()
        self._reserved.add(request_id)
        if hits:
            self._reserved_hits[request_id] = len(hits)
        return list(bm.table(request_id))

    def reserved_hits(self, request_id: str) -> int:
        """How many leading blocks of `request_id`'s reservation the prefix cache supplied (reserve_blocks'
        prefix_hashes): their KV is not to be written from outside."""
        return self._reserved_hits.get(request_id, 0)

    def launch_fence(self) -> LaunchFence:
        """The point behind every device launch queued so far. A block is freed only once every step naming it has
        been launched (async scheduling queues the next step before applying the current one), so blocks reserved
        now are touched by nothing launched later: past this point they may be written from outside, whatever
        steps were queued since. On each TP follower the point lies after as many of rank 0's launches."""
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return LaunchFence(event, self.followers.launches if self.followers is not None else None)

    def order_after(self, events: Sequence[torch.cuda.Event]) -> None:
        """Every device launch from now on (steps, block copies, later launch fences) runs after `events`: the copies
        of KV still landing in blocks reserved here, so their request can be started, or its blocks freed, before
        the copies end (a step that reads them, or a later write into them, waits on the device). TP=1 only: a
        follower's launches are not ordered by rank 0's stream. Relies on every launch (steps from the step thread,
        calls from the loop) going to the device's default stream: no step runs under `torch.cuda.stream(...)`.
        On the CPU there is no device queue to order (and no event to wait for)."""
        if not events or self.device.type != "cuda":
            return
        if self.followers is not None:
            raise ValueError("order_after: a tensor-parallel engine's followers launch on their own streams")
        stream = torch.cuda.current_stream(self.device)
        if stream != torch.cuda.default_stream(self.device):
            raise RuntimeError(f"order_after: the engine launches on the device's default stream, not {stream!r}")
        for event in events:
            stream.wait_event(event)

    def fork_reservation(self, src_id: str, dst_id: str, num_tokens: int) -> bool:
        """Reserve blocks for `dst_id` holding a copy-on-write fork of the first `num_tokens` tokens of KV of
        `src_id` (a reservation whose KV has arrived, or a pinned group prefill): full blocks are shared (ref
        counts), the partial last block is copied on the device (engine.block_manager.fork). Then start it with
        add_prefilled_request(dst_id, ...), or abort(dst_id). False when no block is free now."""
        src = self.scheduler.requests.get(src_id)
        if src_id not in self._reserved and (src is None or src.status != RequestStatus.PINNED):
            raise ValueError(f"request {src_id!r} is neither a reservation nor a pinned prefill")
        if dst_id in self.scheduler.requests or dst_id in self._reserved or dst_id in self._held:
            raise ValueError(f"request id {dst_id!r} is already in use")
        copies = self.block_manager.fork(src_id, dst_id, num_tokens)
        if copies is None:
            return False
        self._offload_now()
        self.runner.copy_blocks(copies)  # queued after any step in flight (on every rank)
        self._reserved.add(dst_id)
        return True

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                              params: SamplingParams, first_logprob: TokenLogprob | None = None,
                              prior_output_ids: Sequence[int] = (), priority: int = 0) -> StepOutput | None:
        """Decode side: start a request whose KV (prompt, then prior outputs) is in the blocks reserved under its
        id; `first_token_id` is the output the prefill sampled after them (output index len(prior_output_ids)).
        `priority` orders it as add_request's does, once it is preempted, and makes it a later victim than requests
        of a worse priority (engine.core.waiting). Returns a StepOutput if that token already ends it (then its
        blocks are freed at once)."""
        if request_id not in self._reserved or request_id in self._held:
            raise ValueError(f"request {request_id!r} has no reserved blocks (call reserve_blocks first)")
        prior = self._validate(request_id, prompt_token_ids, params, prior_output_ids)
        check_token_ids(request_id, "first_token_id", [first_token_id], self.model_config.vocab_size)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id!r}: priority must be an int, got {priority!r}")
        req = self._request(request_id, prompt_token_ids, params, False, prior, priority)
        if self._grammar_pending(params):  # held, its blocks still booked, until the loader is done
            self._held[request_id] = _Held(req, (first_token_id, first_logprob))
            return None
        return self._start_prefilled(req, first_token_id, first_logprob)

    def _start_prefilled(self, req: Request, first_token_id: int, first_logprob: TokenLogprob | None
                         ) -> StepOutput | None:
        """add_prefilled_request's start, once the request's grammar (if any) can be made."""
        request_id = req.request_id
        # the prefill sampled it under the grammar; where the request's bans left no allowed token it breaks it,
        # and the request ends with "error", as it would have where it was sampled
        grammar = self._grammar_row(request_id, req.params, (*req.prior_output_ids, first_token_id),
                                    last_may_fail=True)
        self.scheduler.add_prefilled(req)
        self._reserved.discard(request_id)
        self.num_handoff_hit_blocks += self._reserved_hits.pop(request_id, 0)
        req.append_token(first_token_id, first_logprob)
        if grammar is not None:
            self.grammar.attach(request_id, grammar)
            req.finish_reason = req.finish_reason or self.grammar.finish_reason(request_id)
        if req.finish_reason is not None:
            self.scheduler.finish(request_id, req.finish_reason)
            return StepOutput(request_id, [], [], req.finish_reason)
        return None

    # ---- stepping
    def step(self, layer_hook: LayerHook | None = None) -> list[StepOutput]:
        """One step. `layer_hook(sched)`, called once the step is scheduled, may return a callback that runs after
        each layer has written its K/V (layer-wise KV pushes: prefill_pool.kv_push); such a step runs eagerly."""
        start = time.perf_counter()
        try:
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            return self._step(layer_hook)
        finally:
            self.num_steps += 1
            self.step_time_last_s = time.perf_counter() - start
            self.step_time_total_s += self.step_time_last_s
            if self.step_budget is not None and self._applied is not None:
                self.step_budget.observe(*self._applied, self.step_time_last_s)
                self.scheduler.prefill_cap = self.step_budget.tokens
            if self.swap_space is not None and self._applied is not None:  # auto's recompute cost
                self.swap_space.observe_prefill(self._applied[1], self.step_time_last_s)
            self._applied = None

    def _step(self, layer_hook: LayerHook | None) -> list[StepOutput]:
        outputs = [StepOutput(rid, [], [], "expired", prefill_only=True) for rid in self.scheduler.expired_pins()
                   if self.scheduler.finish(rid, "expired")]
        self.num_expired_pins += len(outputs)
        outputs += self._admit_held()
        if self._held and not self.scheduler.has_work and self._in_flight is None:  # only held requests wait
            return outputs
        if self._in_flight is not None:
            return outputs + self._overlapped_step(may_continue=layer_hook is None)
        sched = self.scheduler.schedule()
        on_layer_done = layer_hook(sched) if layer_hook is not None and sched.chunks else None
        self._move_swapped(sched)
        launched = self.runner.launch(sched, self._params(sched), on_layer_done=on_layer_done,
                                      extras=plan_extras(sched, self.scheduler.requests))
        if self.overlap and on_layer_done is None and sched.chunks and not self.scheduler.plans_alone(sched):
            self._in_flight = launched  # applied by the next step(), after it queued the step that follows
            return outputs
        return outputs + self._apply(launched)

    def _overlapped_step(self, may_continue: bool) -> list[StepOutput]:
        """Queue the step after the one in flight (Scheduler.schedule_after: unless only schedule() may plan it),
        then wait for the one in flight and apply its tokens."""
        current, self._in_flight = self._in_flight, None
        nxt = self.scheduler.schedule_after(current.sched) if may_continue else None
        if nxt is not None:
            self._move_swapped(nxt)
            self._in_flight = self.runner.launch(nxt, self._params(nxt), after=current)
        return self._apply(current)

    def _move_swapped(self, sched: SchedulerOutput) -> None:
        """Queue the step's KV copies to and from the host (preempted requests swapped out, resumed ones swapped
        in; evicted prefix blocks to the host tier, prefixes restored from it: engine.runner.host_tier_store) ahead
        of the step, on the stream it launches on."""
        if sched.swap_out:
            self.swap_store.copy_out(sched.swap_out)
        if sched.swap_in:
            self.swap_store.copy_in(sched.swap_in)
        if self.host_tier is not None:
            if sched.tier_out or sched.tier_in:
                timer = self.host_tier_store.move(sched.tier_out, sched.tier_in)
                for rid in sched.restored:  # for the request's kv_restore phase (engine.core.request_timing)
                    self.scheduler.requests[rid].restore_timer = timer
            self.host_tier.end_step()

    def _offload_now(self) -> None:
        """Blocks taken outside a step (a reservation, a fork) evicted cached ones: their copies to the host tier go
        now, ahead of any write into them."""
        if self.host_tier is not None:
            self.host_tier_store.copy_out_now(self.host_tier.store(self.block_manager.take_evicted()))

    def _host_tier(self, config: EngineConfig) -> tuple[HostTier | None, HostTierStore | None]:
        """The host tier and its store, sized by kv_host_cache_bytes (None: auto where the tier can run)."""
        size = config.kv_host_cache_bytes
        if size is None:  # on a GPU only when set until its start cost and gain are measured (docs/kv_tiers.md)
            usable = config.enable_prefix_caching and config.tensor_parallel_size == 1 and self.device.type != "cuda"
            size = auto_host_cache_bytes(self.device.type) if usable else 0
        store = build_host_tier_store(size, self.kv_cache) if size else None
        if store is None:
            if config.kv_host_cache_bytes:
                block_bytes = self.kv_cache[0].numel() * self.kv_cache.element_size()
                raise ValueError(f"EngineConfig.kv_host_cache_bytes {size} holds no KV block ({block_bytes} bytes)")
            return None, None
        return HostTier(store.copies.host.shape[0], store.block_bytes), store

    def _apply(self, launched: LaunchedStep) -> list[StepOutput]:
        sampled = launched.result()
        if self.step_budget is not None or self.swap_space is not None:  # what the step step() times carried
            chunks = launched.sched.chunks
            decodes = sum(1 for c in chunks if len(c.token_ids) == 1 and c.output_index > 0)
            self._applied = (decodes, launched.sched.num_tokens - decodes)
        extra = record_extras(launched.sampling, launched.prompt_logprobs, launched.fork_first,
                              self.scheduler.requests)
        outputs = self.scheduler.update(launched.sched, sampled, self.config.pin_lease_s)
        if extra:
            outputs = [with_extras(o, extra[o.request_id]) if o.request_id in extra else o for o in outputs]
        if self.grammar is None:
            return outputs
        return self.grammar.after_update(outputs, self.scheduler.requests, self.scheduler.finish)

    def start_grammar_load(self, on_ready: Callable[[], None] | None = None) -> GrammarLoader:
        """Build the structured-output machinery on a thread of its own (engine.sampling.grammar_loader), from
        any thread; `on_ready()` is called on that thread when it ends. Structured requests that arrive meanwhile
        are held, the others step on. Once only: later calls return the first loader."""
        from engine.sampling.grammar_loader import GrammarLoader

        if self.grammar_loader is None:
            self.grammar_loader = GrammarLoader(self._build_grammar, on_ready)
        return self.grammar_loader

    def prepare_grammar(self) -> bool:
        """Build the structured-output machinery now, on this thread (False: llguidance is not installed), unless
        a loader builds it (start_grammar_load: then True once it is done). Built with the first structured request
        of an engine without a loader (an offline LLM)."""
        if self.grammar is None:
            if self.grammar_loader is not None:
                try:
                    self.grammar = self.grammar_loader.manager()
                except ImportError:
                    return False
                except Exception as e:  # a refusal, as add_request's are: the request fails, the engine goes on
                    raise ValueError(f"structured outputs are unavailable here: the grammar tables failed to build "
                                     f"({type(e).__name__}: {e})") from e
                return self.grammar is not None
            try:
                self.grammar = self._build_grammar()
            except ImportError:
                return False
        return True

    def _build_grammar(self) -> GrammarManager:
        from engine.sampling.grammar import GrammarManager  # llguidance: only where outputs are structured

        return GrammarManager(self.tokenizer.to_json(), self.model_config.vocab_size, self.model_config.eos_token_ids,
                              self.device, self.config.max_num_seqs)

    def _grammar_pending(self, params: SamplingParams) -> bool:
        """A structured request must wait: its grammar's loader is still building."""
        return (params.structured is not None and self.grammar is None and self.grammar_loader is not None
                and not self.grammar_loader.done())

    def _admit_held(self) -> list[StepOutput]:
        """Start the held structured requests once their loader is done, in arrival order; one whose grammar
        cannot be made (the loader failed, its spec does not compile, its prior outputs break it) ends with
        finish_reason "error", its blocks freed."""
        if not self._held or not self.grammar_loader.done():
            return []
        outputs = []
        for rid, held in list(self._held.items()):
            del self._held[rid]
            try:
                if held.first is None:
                    grammar = self._grammar_row(rid, held.req.params, held.req.prior_output_ids)
                    self.scheduler.add(held.req)
                    self.grammar.attach(rid, grammar)
                    continue
                out = self._start_prefilled(held.req, *held.first)
            except Exception as e:  # noqa: BLE001 - the request ends; the engine steps on
                log.warning("request %s: its structured output cannot start: %s", rid, e)
                self.abort(rid)
                out = StepOutput(rid, [], [], "error", prefill_only=held.req.prefill_only)
            if out is not None:
                outputs.append(out)
        return outputs

    def _grammar_row(self, request_id: str, params: SamplingParams, outputs: Sequence[int],
                     last_may_fail: bool = False):
        """The request's grammar matcher, having consumed the outputs it has (None without a structured spec;
        GrammarManager.make)."""
        if params.structured is None:
            return None
        if not self.prepare_grammar():
            raise ValueError("structured outputs need the llguidance package, which is not installed")
        self.runner.logits_hook = self.grammar.constrain  # only once a request is constrained: none cost nothing
        return self.grammar.make(request_id, params.structured, outputs, last_may_fail)

    def _params(self, sched: SchedulerOutput) -> dict[str, SamplingParams]:
        return {c.request_id: self.scheduler.requests[c.request_id].params for c in sched.chunks}

    def has_unfinished(self) -> bool:
        """Requests wait or run. A step in flight whose requests all ended since is left to the next step() to
        drop: its device work only touches their freed blocks, before anything queued later."""
        return self.scheduler.has_work or bool(self._held)

    def load(self) -> EngineLoad:
        """The engine's gauges now and its counters since start (see EngineLoad)."""
        s = self.scheduler
        pending = sum(r.num_pending_tokens for r in s.waiting) + sum(
            r.num_pending_tokens for r in s.running if r.num_pending_tokens > 1) + sum(
            h.req.num_pending_tokens for h in self._held.values() if h.first is None)
        pinned = sum(1 for r in s.requests.values() if r.status == RequestStatus.PINNED)
        return EngineLoad(
            pending, len(s.waiting) + len(self._held), len(s.running), pinned, self.block_manager.num_free_blocks,
            self.num_kv_blocks,
            steps=self.num_steps, cached_blocks=self.block_manager.num_cached_blocks,
            num_reserved=len(self._reserved), step_time_last_s=self.step_time_last_s,
            step_time_total_s=self.step_time_total_s, scheduled_tokens_total=s.num_scheduled_tokens,
            sampled_tokens_total=s.num_sampled_tokens, prefix_query_tokens_total=s.num_prefix_query_tokens,
            prefix_hit_tokens_total=s.num_prefix_hit_tokens, preemptions_total=s.num_preemptions,
            preemptions_decode_total=s.preemptions_by_cause["decode"],
            preemptions_prompt_total=s.preemptions_by_cause["prompt"], head_bypassed_total=s.waiting.num_bypassed,
            expired_pins_total=self.num_expired_pins, handoff_hit_blocks_total=self.num_handoff_hit_blocks,
            iteration_tokens_total=s.iteration_tokens.total, iteration_token_counts=tuple(s.iteration_tokens.counts),
            grammar_load_s=self.grammar_loader.seconds if self.grammar_loader is not None else 0.0,
            taken_at_s=time.monotonic(), **self._budget_figures(), **self._swap_figures(), **self._tier_figures())

    def _budget_figures(self) -> dict[str, float]:
        b = self.step_budget
        if b is None:
            return {}
        return {"prefill_budget_tokens": b.tokens, "decode_step_s": b.base_s or 0.0,
                "prefill_token_s": b.per_token_s or 0.0}

    def _swap_figures(self) -> dict[str, int]:
        w = self.swap_space
        if w is None:
            return {}
        return {"swapped_out_total": w.num_swapped_out, "swapped_in_total": w.num_swapped_in,
                "swap_out_bytes_total": w.blocks_out * w.block_bytes,
                "swap_in_bytes_total": w.blocks_in * w.block_bytes,
                "swap_full_total": w.num_full, "swap_used_blocks": w.num_slots - w.num_free}

    def _tier_figures(self) -> dict[str, int]:
        t = self.host_tier
        if t is None:
            return {}
        return {"host_tier_hit_blocks_total": t.hits, "host_tier_miss_blocks_total": t.misses,
                "host_tier_in_bytes_total": t.stored * t.block_bytes,
                "host_tier_out_bytes_total": t.hits * t.block_bytes,
                "host_tier_evictions_total": t.evictions, "host_tier_dropped_total": t.dropped,
                "host_tier_used_blocks": t.num_used, "host_tier_total_blocks": t.num_slots,
                "host_tier_used_bytes": t.num_used * t.block_bytes,
                "host_tier_capacity_bytes": t.num_slots * t.block_bytes}

    def check_integrity(self) -> dict[str, int]:
        """Assert block ownership; return counts {"free", "cached", "pinned", "in_use", "total"} and
        "expired_pins", the pinned requests their lease freed since start."""
        counts = self.block_manager.check_integrity()
        known = set(self.scheduler.requests) | self._reserved
        tables = self.block_manager.owners()
        assert set(tables) <= known, f"blocks held by unknown owners: {sorted(set(tables) - known)}"
        pinned_owners = self._reserved | {r.request_id for r in self.scheduler.requests.values()
                                          if r.status == RequestStatus.PINNED}
        active = {b for owner, t in tables.items() if owner not in pinned_owners for b in t}
        pinned = {b for owner in pinned_owners for b in tables.get(owner, [])} - active
        for r in self.scheduler.requests.values():
            holds = r.request_id in tables
            assert holds == (r.status != RequestStatus.WAITING), f"request {r.request_id} ({r.status}) blocks"
        result = {"free": counts["free"], "cached": counts["cached"], "pinned": len(pinned),
                  "in_use": len(active), "total": counts["total"]}
        if self.swap_space is not None:  # every host slot free or held by one swapped-out (waiting) request
            swapped = [r for r in self.scheduler.requests.values() if r.swap_slots is not None]
            assert all(r.status == RequestStatus.WAITING for r in swapped), "a swapped-out request is not waiting"
            self.swap_space.check_integrity(r.swap_slots for r in swapped)
        assert result["free"] + result["cached"] + result["pinned"] + result["in_use"] == result["total"]
        if self.host_tier is not None:  # per tier: every host slot free or holding one block
            tier = self.host_tier.check_integrity()
            result |= {f"host_{k}": v for k, v in tier.items()}
        return result | {"expired_pins": self.num_expired_pins}

    def rank_call(self, rank: int, method: str, *args) -> Future:
        """Call `method` of follower `rank`'s rank service (LLMEngine(rank_service=...)); thread-safe, unlike the
        rest of the engine: it touches no engine state, only the call pipes."""
        if self.followers is None or self.followers.calls is None:
            raise RuntimeError("this engine has no tensor-parallel rank services")
        if not 1 <= rank < self.config.tensor_parallel_size:
            raise ValueError(f"rank {rank} is not a follower rank of TP size {self.config.tensor_parallel_size}")
        return self.followers.calls.call(rank, method, *args)

    def close(self) -> None:
        """Stop the tensor-parallel followers (nothing to do at TP=1); the engine cannot step afterwards."""
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
