"""What a worker reports about its engine (torch-free): WorkerInfo once at start, EngineLoad with every reply."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

# vLLM's vllm:iteration_tokens_total buckets (tokens per engine step); a last count holds the steps above them
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class EngineLoad:
    """Gauges (the state now) and counters (`*_total`, since the engine started; a rate is the difference of two
    reports). Every field but iteration_token_counts (a histogram's counts) is a number, so a reader can export them.
    Derived figures: mean step time = step_time_total_s / steps; tokens per step = scheduled_tokens_total / steps;
    prefix-cache hit rate = prefix_hit_tokens_total / prefix_query_tokens_total."""

    queued_prompt_tokens: int  # tokens admitted but not yet computed (waiting requests + running prefills)
    num_waiting: int           # requests queued, holding no blocks (new, or preempted and waiting to recompute)
    num_running: int
    num_pinned: int            # prefill-only requests holding blocks until their KV is pulled
    free_blocks: int           # free + evictable cached
    total_blocks: int
    steps: int = 0             # engine steps since start
    cached_blocks: int = 0     # of free_blocks, those holding prefix-cache content
    num_reserved: int = 0      # decode-side reservations whose KV is being written in
    # with a decode step target (EngineConfig.decode_step_target_s): prompt tokens a step that decodes may carry now,
    # a step of the decode rows alone and each prompt token's share of a step (running averages); 0 without one
    prefill_budget_tokens: int = 0
    decode_step_s: float = 0.0
    prefill_token_s: float = 0.0
    # a prefill lane's seconds per prompt token (sm_split_decode_sms) for a prompt arriving now; 0: no lane, none
    # measured yet, or its split table chunks prompts beside the current decode batch (a row of 0 SMs)
    lane_token_s: float = 0.0
    step_time_last_s: float = 0.0   # host wall time of the last step (scheduling, device work, bookkeeping)
    step_time_total_s: float = 0.0  # summed over all steps
    scheduled_tokens_total: int = 0     # tokens computed on the device (prefill chunks, recomputes, decodes)
    sampled_tokens_total: int = 0       # tokens generated
    prefix_query_tokens_total: int = 0  # tokens of requests admitted (each admission looks up the prefix cache)
    prefix_hit_tokens_total: int = 0    # of those, tokens whose KV the prefix cache supplied
    preemptions_total: int = 0          # running requests sent back to the queue for lack of blocks
    preemptions_decode_total: int = 0   # of those, preempted because a decode row needed a new block
    preemptions_prompt_total: int = 0   # or because a prompt chunk (or a recompute) needed blocks
    head_bypassed_total: int = 0        # waiting requests started ahead of a head short of blocks (engine.core.waiting)
    expired_pins_total: int = 0         # pinned prefill-only requests freed by their lease (nobody released them)
    lane_jobs_total: int = 0            # steps' prompt chunks run on the prefill lane (sm_split_decode_sms)
    handoff_hit_blocks_total: int = 0   # blocks of handed-over requests' KV this worker's prefix cache held: not moved
    # prompt prefixes moved between workers (engine.prefix_exchange): blocks lent to fetchers (of those, copied up from
    # this worker's host tier first), and blocks fetched from a lender into this worker's prefix cache
    lent_blocks_total: int = 0
    lent_host_blocks_total: int = 0
    fetched_blocks_total: int = 0
    # preempted requests whose KV went to host memory instead of being recomputed (EngineConfig.preemption_mode swap
    # or auto; 0 with recompute): swapped out and back in, the bytes copied each way, preemptions that found the swap
    # space full (recomputed), and the host blocks held now
    swapped_out_total: int = 0
    swapped_in_total: int = 0
    swap_out_bytes_total: int = 0
    swap_in_bytes_total: int = 0
    swap_full_total: int = 0
    swap_used_blocks: int = 0
    # the host tier under the prefix cache (engine.core.host_tier; all 0 without one): blocks found there and not
    # found at admissions, bytes copied into it (evicted device blocks) and out of it (restored prefixes), entries it
    # evicted for room, evicted device blocks it could not take, and its occupancy now
    host_tier_hit_blocks_total: int = 0
    host_tier_miss_blocks_total: int = 0
    host_tier_hit_tokens_total: int = 0  # prompt tokens admitted with their KV copied back (prefix_query_tokens')
    host_tier_in_bytes_total: int = 0
    host_tier_out_bytes_total: int = 0
    host_tier_evictions_total: int = 0
    host_tier_dropped_total: int = 0
    host_tier_recompute_blocks_total: int = 0  # found there but computed: the copy would have cost more
    host_tier_used_blocks: int = 0
    host_tier_total_blocks: int = 0
    host_tier_used_bytes: int = 0
    host_tier_capacity_bytes: int = 0
    # the hosting process's garbage collector (engine.gc_pauses; a pool worker fills them in): collections, full ones,
    # their summed and longest pause (the step thread waits through each)
    gc_pauses_total: int = 0
    gc_full_collections_total: int = 0
    gc_pause_seconds_total: float = 0.0
    gc_pause_max_s: float = 0.0
    # vLLM's iteration_tokens_total histogram (IterationTokens): over the steps that produced tokens, the tokens each
    # carried (summed) and the steps per bucket of ITERATION_TOKEN_BUCKETS (a tuple: the one field not a number)
    iteration_tokens_total: int = 0
    iteration_token_counts: tuple[int, ...] = ()
    # seconds the structured-output tables took to build on their own thread after the worker became routable (a
    # start-up phase that runs in the background: engine.sampling.grammar_loader); 0 until built, or never started
    grammar_load_s: float = 0.0
    # CUDA graphs left for after start (EngineConfig.graph_capture "deferred"; engine.runner.deferred_graphs): buckets
    # still to capture, and the seconds their captures took between steps once none is left (0 until then)
    graphs_pending: int = 0
    graph_capture_s: float = 0.0
    # when the report was taken, on the reporting process's monotonic clock (0: unknown): a rate between two reports
    # of one worker divides by this difference, not by when a reader happened to receive them (not compared: two
    # reports of the same state are equal whenever they were taken)
    taken_at_s: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class WorkerInfo:
    name: str
    role: str  # "prefill" | "decode" | "collocated"
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    agent_metadata: bytes | None  # the worker's kvtransfer agent, serialized (None when it has none)
    startup_s: tuple[tuple[str, float], ...] = ()  # seconds per start-up phase, in order (pool_worker.start_phases)
    pid: int = 0     # the worker's process (rank 0 of a TP group), for operators' drills and /health
    host: str = ""   # the node it runs on
    outputs_at: tuple[str, int, bytes] | None = None  # a decode worker's output stream: host, port, token


class PhaseClock:
    """Seconds per start-up phase, in order (time.monotonic): `lap(name)` closes the phase that ran since the
    previous lap (or since the clock was made)."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []
        self._last = time.monotonic()

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append((phase, round(now - self._last, 3)))
        self._last = now


@dataclass
class IterationTokens:
    """vLLM's `vllm:iteration_tokens_total`, kept by an engine's scheduler: `observe(tokens)` once per step that
    produced tokens, with the tokens vLLM counts for it: the prompt tokens of the requests whose first token this
    engine sampled in the step (their whole prompt, cached or handed-over tokens included) plus the tokens sampled.
    A step that computed a prompt chunk and sampled nothing is not a step here (vLLM records steps with outputs)."""

    total: int = 0
    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))

    def observe(self, tokens: int) -> None:
        self.total += tokens
        self.counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1  # the first bucket with le >= tokens
