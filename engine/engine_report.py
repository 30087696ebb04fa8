"""What LLMEngine reports about itself: load() (its gauges and counters, EngineLoad: every worker reply and the
metrics carry it: engine.async_engine, pool_worker.worker), check_integrity() (block ownership asserted, counts
returned: pool_worker.worker's check_integrity command, warm-up, tests) and start_counting() (nothing cached, every
counter at zero: after a warm-up or a start probe). A mixin of LLMEngine; relies on its state.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.core.request import RequestStatus
from engine.load import EngineLoad, IterationTokens

if TYPE_CHECKING:
    from engine.core.block_manager import BlockManager
    from engine.core.host_tier import HostTier
    from engine.core.scheduler import Scheduler
    from engine.core.step_budget import StepBudget
    from engine.core.swap_space import SwapSpace
    from engine.grammar_holding import _Held
    from engine.sampling.grammar_loader import GrammarLoader


class EngineReport:
    """LLMEngine's load() and check_integrity() (see the module)."""

    # LLMEngine's, set in its __init__
    num_kv_blocks: int
    scheduler: Scheduler
    block_manager: BlockManager
    grammar_loader: GrammarLoader | None
    step_budget: StepBudget | None
    swap_space: SwapSpace | None
    host_tier: HostTier | None
    _reserved: set[str]
    _held: dict[str, _Held]
    num_steps: int
    step_time_last_s: float
    step_time_total_s: float
    num_expired_pins: int
    num_handoff_hit_blocks: int
    _leases: set[str]
    num_lent_blocks: int
    num_lent_host_blocks: int
    num_fetched_blocks: int

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
            expired_pins_total=self.num_expired_pins, lane_jobs_total=self.lane.jobs if self.lane else 0,
            lane_token_s=self.lane.token_s if self.lane and self.lane.takes(self._decoding_rows()) else 0.0,
            handoff_hit_blocks_total=self.num_handoff_hit_blocks,
            lent_blocks_total=self.num_lent_blocks, lent_host_blocks_total=self.num_lent_host_blocks,
            fetched_blocks_total=self.num_fetched_blocks,
            iteration_tokens_total=s.iteration_tokens.total, iteration_token_counts=tuple(s.iteration_tokens.counts),
            grammar_load_s=self.grammar_loader.seconds if self.grammar_loader is not None else 0.0,
            graphs_pending=self.deferred_graphs.left if self.deferred_graphs else 0,
            graph_capture_s=self.deferred_graphs.seconds if self.deferred_graphs and not self.deferred_graphs.left
            else 0.0,
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
                "host_tier_hit_tokens_total": self.scheduler.num_host_hit_tokens,
                "host_tier_in_bytes_total": t.stored * t.block_bytes,
                "host_tier_out_bytes_total": t.hits * t.block_bytes,
                "host_tier_evictions_total": t.evictions, "host_tier_dropped_total": t.dropped,
                "host_tier_recompute_blocks_total": t.chose_recompute,
                "host_tier_used_blocks": t.num_used, "host_tier_total_blocks": t.num_slots,
                "host_tier_used_bytes": t.num_used * t.block_bytes,
                "host_tier_capacity_bytes": t.num_slots * t.block_bytes}

    def start_counting(self) -> None:
        """Nothing cached on the device or in the host tier and every counter at zero, as right after start: what a
        warm-up's or a start probe's requests left (engine.runner.warmup, engine.step_rates) is not the server's.
        Call with no request in flight."""
        self.block_manager.reset_prefix_cache()
        tier = self.host_tier
        if tier is not None:
            tier.clear()
            tier.take_changes()  # nothing for the fleet's index: it held these requests' blocks only
            tier.hits = tier.misses = tier.stored = tier.evictions = tier.dropped = tier.chose_recompute = 0
        self.num_steps, self.step_time_last_s, self.step_time_total_s = 0, 0.0, 0.0
        s = self.scheduler
        s.num_preemptions = s.num_prefix_query_tokens = s.num_prefix_hit_tokens = s.num_host_hit_tokens = 0
        s.num_scheduled_tokens = s.num_sampled_tokens = 0
        s.iteration_tokens = IterationTokens()
        if self.lane is not None:  # its rate figures stay: measuring them is what a start probe is for
            self.lane.jobs = 0
            for split in self.lane.splits.values():
                split.jobs = 0

    def check_integrity(self) -> dict[str, int]:
        """Assert block ownership; return counts {"free", "cached", "pinned", "in_use", "total"} and
        "expired_pins", the pinned requests their lease freed since start."""
        counts = self.block_manager.check_integrity()
        known = set(self.scheduler.requests) | self._reserved | self._leases
        tables = self.block_manager.owners()
        assert set(tables) <= known, f"blocks held by unknown owners: {sorted(set(tables) - known)}"
        pinned_owners = self._reserved | self._leases | {r.request_id for r in self.scheduler.requests.values()
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
