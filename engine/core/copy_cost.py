"""CopyCost: whether copying KV blocks between the host and the device beats computing their tokens again.

Shared by the two places an engine may copy KV instead of computing it: a preempted request swapped out and back
(engine.core.swap_space, preemption_mode "auto") and a prefix restored from the host tier under the prefix cache
(engine.core.host_tier). A copy of B bytes takes B / copy_bytes_per_s (the host-device bandwidth, measured at start
by engine.runner.swap_store.HostSwapStore.measure_bandwidth); computing T tokens takes T * prefill_token_s (the
engine's own prompt steps, a running average). Until both are measured, the copy is taken: on every machine this
project serves on, a block's copy is far cheaper than its recompute (docs/kv_tiers.md).
"""

from __future__ import annotations

PREFILL_EWMA = 0.2  # weight of a newly timed prompt step in prefill_token_s
MIN_TIMED_PROMPT_TOKENS = 16  # shorter prompt steps are dominated by fixed costs: not timed


class CopyCost:
    def __init__(self) -> None:
        self.copy_bytes_per_s: float | None = None  # host <-> device copy bandwidth (set by the engine)
        self.prefill_token_s: float | None = None   # seconds a prompt token takes (the engine's prompt steps)

    def copy_pays(self, copy_bytes: int, tokens: int) -> bool:
        """Whether copying `copy_bytes` is cheaper than computing `tokens` tokens (True until both are measured)."""
        if self.copy_bytes_per_s is None or self.prefill_token_s is None:
            return True
        return copy_bytes / self.copy_bytes_per_s < tokens * self.prefill_token_s

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        """A step that computed `prompt_tokens` prompt tokens (beside any decode rows) took `seconds`."""
        if prompt_tokens < MIN_TIMED_PROMPT_TOKENS or seconds <= 0:
            return
        per_token = seconds / prompt_tokens
        old = self.prefill_token_s
        self.prefill_token_s = per_token if old is None else (1 - PREFILL_EWMA) * old + PREFILL_EWMA * per_token
