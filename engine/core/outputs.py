"""RequestOutput: what LLM.generate returns for one prompt."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None  # one per generated token, when SamplingParams.logprobs was set
