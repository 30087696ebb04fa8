"""StepBudget: how many prompt tokens a step that also decodes may carry, so that the running streams' time per
token stays under a target (chunked prefill beside decodes, as the adaptive layout's local prefills run).

A step's time is modelled as base + per_token * prompt_tokens: `base`, a step of the current decode rows alone,
and `per_token`, what each prompt token adds, are running averages of the engine's own steps (decode-only steps
measure base; steps with prompt tokens measure per_token above the base). The budget is what fits the target,
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
        self.per_token_s: float | None = None  # each prompt token's share of a step

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """One step's measured time, with what it carried."""
        if prompt_tokens == 0:
            if decode_rows:
                self.base_s = _average(self.base_s, seconds)
            return
        base = self.base_s if decode_rows and self.base_s is not None else 0.0
        self.per_token_s = _average(self.per_token_s, max(seconds - base, 0.0) / prompt_tokens)

    @property
    def tokens(self) -> int:
        """Prompt tokens a step with decode rows may carry now."""
        if self.per_token_s is None or self.per_token_s <= 0:
            return self.floor_tokens if self.per_token_s is None else self.ceiling_tokens
        room = self.target_s - (self.base_s or 0.0)
        return max(self.floor_tokens, min(self.ceiling_tokens, int(room / self.per_token_s)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new
