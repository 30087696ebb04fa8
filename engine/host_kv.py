"""KV copies between the device and the host for LLMEngine: the host tier under the prefix cache (its construction,
_host_tier, called by LLMEngine.__init__), the copies of blocks taken outside a step (_offload_now, and a
reservation's leading blocks restored from the tier, _restore_now; called by engine.handoff_blocks) and each step's
swap and tier copies (_move_swapped, called by LLMEngine's stepping).
A mixin of LLMEngine; relies on its state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.core.copy_cost import CopyCost
from engine.core.host_tier import HostTier
from engine.engine_config import EngineConfig
from engine.runner.host_tier_store import HostTierStore, auto_host_cache_bytes, build_host_tier_store

if TYPE_CHECKING:
    import torch

    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler, SchedulerOutput
    from engine.runner.swap_store import HostSwapStore


class HostKV:
    """LLMEngine's device-host KV copies (see the module)."""

    # LLMEngine's, set in its __init__
    device: torch.device
    kv_cache: torch.Tensor
    scheduler: Scheduler
    block_manager: BlockManager
    host_tier: HostTier | None
    host_tier_store: HostTierStore | None
    swap_store: HostSwapStore | None

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

    def _restorable(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes` (from the first) the host tier holds: a booking's alternative is the handoff writing
        them, not computing them, so every one found is copied back."""
        if self.host_tier is None or not hashes:
            return 0
        return len(self.host_tier.find(hashes))

    def _restore_now(self, hashes: Sequence[bytes], looked_up: int, blocks: Sequence[int]) -> None:
        """Copy the host tier's blocks of `hashes` (a run `_restorable` counted) into device `blocks` now, ahead
        of every later launch; `looked_up` blocks were sought in the tier. Call before _offload_now: the slots
        read are busy, so the stores it queues cannot overwrite them."""
        if self.host_tier is None or looked_up == 0:
            return
        slots = self.host_tier.take(hashes, looked_up)
        self.host_tier_store.copy_in_now(list(zip(slots, blocks, strict=True)))

    def _host_tier(self, config: EngineConfig, cost: CopyCost) -> tuple[HostTier | None, HostTierStore | None]:
        """The host tier and its store, sized by kv_host_cache_bytes (None: auto where the tier can run); its
        restores are weighed by `cost`, whose copy bandwidth is measured here (16 MiB each way, at start)."""
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
        cost.copy_bytes_per_s = store.copies.measure_bandwidth(16 << 20)
        return HostTier(store.copies.host.shape[0], store.block_bytes, cost), store
