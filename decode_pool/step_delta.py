"""StepDelta: one request's new tokens from one engine step, as a decode worker's poll() sends them.

On the wire each delta is a plain tuple in StepDelta's field order (`StepDelta.wire`): Ray pickles a list of
dataclasses (or NamedTuples) through cloudpickle's per-object hook, ~300 us for a poll of 64 StepOutputs on the
2-core CPU machine against ~16 us for the same fields as plain tuples, and on a busy GPU worker that time is taken
on its event loop, under the GIL, beside the thread that steps the engine, once a step. The reader wraps each tuple
back (`StepDelta(*t)`, ~0.5 us) and reads the same attribute names as on StepOutput.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from engine.core.request import PromptLogprob, TokenLogprob
from engine.core.scheduler import StepOutput


class StepDelta(NamedTuple):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finish_reason: str | None
    prompt_logprobs: list[PromptLogprob] | None = None  # with the first token, when params.prompt_logprobs is set
    num_cached_tokens: int | None = None  # with the first token computed here: StepOutput.num_cached_tokens

    @staticmethod
    def wire(outputs: Iterable[StepOutput]) -> list[tuple]:
        """The streamed fields of each output as plain tuples (a decode worker's outputs have no pinned blocks,
        prefill-only, and no fork_first, which group prefills hand over inside the worker)."""
        return [(o.request_id, o.new_token_ids, o.new_logprobs, o.finish_reason, o.prompt_logprobs,
                 o.num_cached_tokens) for o in outputs]
