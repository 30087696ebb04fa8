"""KV copies between the device and the host for LLMEngine: the host tier under the prefix cache (built on a
thread of its own, _start_host_tier, called by LLMEngine.__init__; joined between steps, _attach_host_tier), the
copies of blocks taken outside a step (_offload_now, and a reservation's leading blocks restored from the tier,
_restore_now; called by engine.handoff_blocks) and each step's swap and tier copies (_move_swapped, called by
LLMEngine's stepping).
A mixin of LLMEngine; relies on its state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from engine.core.copy_cost import CopyCost
from engine.core.host_tier import HostTier
from engine.engine_config import EngineConfig
from engine.runner.host_tier_store import HostTierStore, auto_host_cache_bytes, build_host_tier_store

if TYPE_CHECKING:
    from engine.core.block_manager import BlockManager
    from engine.core.scheduler import Scheduler, SchedulerOutput
    from engine.runner.swap_store import HostSwapStore

log = logging.getLogger(__name__)


class HostKV:
    """LLMEngine's device-host KV copies (see the module)."""

    # LLMEngine's, set in its __init__
    device: torch.device
    kv_cache: torch.Tensor
    scheduler: Scheduler
    block_manager: BlockManager
    host_tier: HostTier | None
    host_tier_store: HostTierStore | None
    _tier_build: Future | None  # the host tier being built (_start_host_tier); None once joined or with none
    swap_store: HostSwapStore | None

    def _move_swapped(self, sched: SchedulerOutput) -> None:
        """Queue the step's KV copies to and from the host (preempted requests swapped out, resumed ones swapped
        in; evicted prefix blocks to the host tier, prefixes restored from it: engine.runner.host_tier_store) ahead
        of the step, on the stream it launches on. The evicted blocks are copied down first: the blocks a resumed
        request is swapped into may be among them (swapped in first, the tier kept the resumed request's KV under
        the evicted blocks' hashes, and a later prompt restoring those got it)."""
        tier = self.host_tier
        if tier is not None and sched.tier_out:
            self.host_tier_store.move(sched.tier_out, [])  # on CUDA the launch stream waits for these copies
        if sched.swap_out:
            self.swap_store.copy_out(sched.swap_out)
        if sched.swap_in:
            self.swap_store.copy_in(sched.swap_in)
        if tier is not None:
            if sched.tier_in:
                timer = self.host_tier_store.move([], sched.tier_in)
                for rid in sched.restored:  # for the request's kv_restore phase (engine.core.request_timing)
                    self.scheduler.requests[rid].restore_timer = timer
            tier.end_step()

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
        of every later launch; `looked_up` blocks were sought in the tier. The blocks just taken may have evicted
        cached ones whose copies down (_offload_now) must read them before the copies back overwrite them: so the
        slots are taken first (busy: no store takes them), then the copies down queued, then the copies back.
        (The other way round, the host tier kept the restored KV under the evicted blocks' hashes, and a later
        prompt restoring those was answered from another prompt's KV.)"""
        if self.host_tier is None:
            return
        slots = self.host_tier.take(hashes, looked_up) if looked_up else []
        self._offload_now()
        if slots:
            self.host_tier_store.copy_in_now(list(zip(slots, blocks, strict=True)))

    def _start_host_tier(self, config: EngineConfig, cost: CopyCost) -> None:
        """Size the host tier (kv_host_cache_bytes; None: auto where the tier can run) and start building it on a
        thread of its own: its memory (pinned on CUDA, about half a second a GiB on an H200 host) and the copy
        bandwidth its restores are weighed by (`cost`, 16 MiB each way). Until it joins at a step boundary
        (_attach_host_tier), host_tier and host_tier_store are None. LLMEngine.__init__ waits for it (built beside
        the warm-up on an H200 it slowed both: docs/kv_tiers.md); the late join is kept, tested, for a later design."""
        self.host_tier = self.host_tier_store = None
        self._tier_build: Future | None = None
        size = config.kv_host_cache_bytes
        if size is None:  # on a GPU only when set (docs/kv_tiers.md)
            usable = config.enable_prefix_caching and config.tensor_parallel_size == 1 and self.device.type != "cuda"
            size = auto_host_cache_bytes(self.device.type) if usable else 0
        block_bytes = self.kv_cache[0].numel() * self.kv_cache.element_size()
        if size < block_bytes:
            if config.kv_host_cache_bytes:
                raise ValueError(f"EngineConfig.kv_host_cache_bytes {size} holds no KV block ({block_bytes} bytes)")
            return
        builder = ThreadPoolExecutor(1, thread_name_prefix="host-tier")
        self._tier_build = builder.submit(_build_host_tier, size, self.kv_cache, cost)
        builder.shutdown(wait=False)

    def wait_for_host_tier(self) -> None:
        """Wait until the host tier is built and join it now (the offline LLM and a CPU engine do at start)."""
        self._attach_host_tier(wait=True)

    def _attach_host_tier(self, wait: bool = False) -> None:
        """Join the host tier once built (between steps: the block manager records evictions from here on); a build
        that failed (e.g. no pinned memory to be had) is logged and the engine goes on without a tier."""
        build = self._tier_build
        if build is None or not (wait or build.done()):
            return
        self._tier_build = None
        try:
            tier, store, seconds = build.result()
        except Exception:  # noqa: BLE001 - the tier is a cache: serving goes on without it
            log.exception("host tier: building it failed; this engine runs without one")
            return
        self.host_tier, self.host_tier_store = tier, store
        self.scheduler.tier = tier
        self.block_manager.record_evictions()
        log.info("host tier: %d blocks (%.1f GiB) ready in %.2f s, %.1f GB/s to the device and back", tier.num_slots,
                 tier.num_slots * tier.block_bytes / 2**30, seconds, tier.cost.copy_bytes_per_s / 1e9)


def _build_host_tier(size: int, kv_cache: torch.Tensor, cost: CopyCost) -> tuple[HostTier, HostTierStore, float]:
    """The tier, its store over `size` bytes and the seconds the build took (on the builder's thread)."""
    start = time.perf_counter()
    if kv_cache.is_cuda:
        torch.cuda.set_device(kv_cache.device)
    store = build_host_tier_store(size, kv_cache)
    cost.copy_bytes_per_s = store.copies.measure_bandwidth(16 << 20)
    return HostTier(store.copies.host.shape[0], store.block_bytes, cost), store, time.perf_counter() - start
