"""SamplingParams: how one request chooses its tokens and when it stops. Validated at construction, then frozen."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (the OpenAI/vLLM names).

    temperature == 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p = 1 and min_p = 0 disable those filters.
    `seed` makes the request's samples reproducible whatever else is in the batch and whichever worker runs it.
    `logprobs` = N returns, per generated token, its log-probability and the N most likely alternatives.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1 (disabled) or >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be None or in [0, 20]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "must be None or in [0, 2**63)"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
