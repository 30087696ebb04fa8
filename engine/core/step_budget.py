"""StepBudget: how many prompt tokens a step that also decodes may carry, so that the running streams' time per
token stays under a target (chunked prefill beside decodes, as the adaptive layout's local prefills run).

A step's time is modelled as base + per_token * prompt_tokens: `base`, a step of the current decode rows alone,
and `per_token`, what each prompt token adds, are running averages of the engine's own steps (decode-only steps
measure base; steps with at least `floor_tokens` prompt tokens measure per_token: their time above the base over
their prompt tokens, both averaged apart, so that a step's weight is its tokens; a step of a few tokens, where
fixed costs dominate, would otherwise make every prompt token look dear). The budget is what fits the target,
at least `floor_tokens` (prompts placed here always progress) and at most `ceiling_tokens` (the step's token
budget). Until a step with prompt tokens has been measured the budget is the floor. Only the engine thread uses it.
"""

from __future__ import annotations

EWMA = 0.2  # weight of the newest step in each average


class StepBudget:
    def __init__(self, target_s: float, floor_tokens: int, ceiling_tokens: int) -> None:
        if target_s <= 0 or not 0 < floor_tokens <= ceiling_tokens:
            raise ValueError(f"StepBudget: target_s {target_s} must be > 0 and 0 < floor {floor_tokens} <= "
                             f"ceiling {ceiling_tokens}")
        self.target_s = target_s
        self.floor_tokens = floor_tokens
        self.ceiling_tokens = ceiling_tokens
        self.base_s: float | None = None      # a step of the decode rows alone
        self._above_base_s: float | None = None  # averages over steps with prompt tokens: their time above the base
        self._prompt_tokens: float | None = None  # ... and their prompt tokens

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """One step's measured time, with what it carried."""
        if prompt_tokens == 0:
            if decode_rows:
                self.base_s = _average(self.base_s, seconds)
            return
        if prompt_tokens < self.floor_tokens:
            return
        base = self.base_s if decode_rows and self.base_s is not None else 0.0
        self._above_base_s = _average(self._above_base_s, max(seconds - base, 0.0))
        self._prompt_tokens = _average(self._prompt_tokens, prompt_tokens)

    @property
    def per_token_s(self) -> float | None:
        """Each prompt token's share of a step (None until a step with prompt tokens was measured)."""
        if self._above_base_s is None:
            return None
        return self._above_base_s / self._prompt_tokens

    @property
    def tokens(self) -> int:
        """Prompt tokens a step with decode rows may carry now."""
        if self.per_token_s is None or self.per_token_s <= 0:
            return self.floor_tokens if self.per_token_s is None else self.ceiling_tokens
        room = self.target_s - (self.base_s or 0.0)
        return max(self.floor_tokens, min(self.ceiling_tokens, int(room / self.per_token_s)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new
