"""SamplingParams: how one request chooses its tokens and when it stops. Validated at construction, then frozen."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.sampling.structured import StructuredSpec

MAX_LOGIT_BIAS = 300          # entries, as OpenAI
MAX_BAD_WORDS = 256           # token sequences (each word may give two: with and without a leading space)
MAX_BAD_WORD_TOKENS = 32      # tokens in one bad word (the engine keeps each request's last 31 outputs for them)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (the OpenAI/vLLM names).

    temperature == 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p = 1 and min_p = 0 disable those filters.
    `seed` makes the request's samples reproducible whatever else is in the batch and whichever worker runs it.
    `logprobs` = N returns, per generated token, its log-probability and the N most likely alternatives.
    `prompt_logprobs` = N (vLLM's) returns the same for every prompt token after the first, computed during prefill
    (such a request skips the prefix cache: cached positions have no logits).

    Logits processing (engine.logits_processing), in vLLM's order before temperature and the filters:
    `logit_bias` ((token id, bias in [-100, 100]) pairs, sorted; a dict is accepted) is added; until `min_tokens`
    outputs exist, EOS (unless ignore_eos) and `stop_token_ids` are banned; `bad_words_token_ids` (token sequences)
    ban a sequence's last token where the outputs end with the rest of it; then `repetition_penalty` (vLLM/HF: over
    prompt and output tokens, positive logits divided, others multiplied); `frequency_penalty` (times each output
    token's count) and `presence_penalty` (once per distinct output token) are subtracted, as OpenAI defines them.
    Outputs of a resumed request (prior_output_ids) count as outputs.
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
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    min_tokens: int = 0
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    structured: StructuredSpec | None = None  # the output must match it (engine.structured, engine.grammar)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        object.__setattr__(self, "bad_words_token_ids",
                           tuple(tuple(int(t) for t in word) for word in self.bad_words_token_ids))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"SamplingParams.{name} must be finite, got {getattr(self, name)!r}")
        ids = [t for t, _ in self.logit_bias]
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1 (disabled) or >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be None or in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "must be None or in [0, 20]"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "must be None or in [0, 2**63)"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("logit_bias", len(self.logit_bias) <= MAX_LOGIT_BIAS, f"must have at most {MAX_LOGIT_BIAS} entries"),
            ("logit_bias", all(-100 <= b <= 100 for _, b in self.logit_bias), "biases must be in [-100, 100]"),
            ("logit_bias", len(set(ids)) == len(ids) and all(t >= 0 for t in ids),
             "token ids must be distinct and >= 0"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "must be >= 0"),
            ("bad_words_token_ids", len(self.bad_words_token_ids) <= MAX_BAD_WORDS,
             f"must hold at most {MAX_BAD_WORDS} words"),
            ("bad_words_token_ids", all(1 <= len(w) <= MAX_BAD_WORD_TOKENS and min(w) >= 0
                                        for w in self.bad_words_token_ids),
             f"each word must be 1 to {MAX_BAD_WORD_TOKENS} token ids >= 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def counts_tokens(self) -> bool:
        """Whether sampling reads the request's token counts (a penalty is set)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def reads_tail(self) -> bool:
        """Whether sampling reads the request's last outputs (a bad word of several tokens)."""
        return any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processing applies to this request (engine.logits_processing); False costs nothing."""
        return self.counts_tokens or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words_token_ids)
