"""When a prefill lane pays (issue 43): the prompts waiting go to the lane (beside the decode steps, on SMs of their
own) or are chunked into the decode steps under the step budget (engine.core.step_budget).

Measured on one H200 (docs/benchmark-log.md, "One GPU, both phases"): a decode step beside the lane takes ~1.4x its
time alone, and the lane prefills at ~0.6 of the whole GPU's rate; chunking under a decode step target keeps every
step within it but gives prompts only the tokens the target leaves. So, from the engine's own figures:
- no decode step target (no StepBudget), or no lane figures yet: the lane, which keeps prompt tokens out of the
  decode steps altogether;
- a decode step on the lane misses the target: chunking, which meets it by construction; but only while that figure
  is recent (FIGURE_TTL_S): passed over, the lane would never measure its steps again, and the decode batch it
  missed the target at may be long gone, while chunking under a tight budget can leave prompts queued behind
  a few dozen tokens a step. An older figure gives the lane a job, which measures it anew;
- otherwise whichever finishes the waiting prompt tokens first: chunking needs ceil(pending / cap) steps of about
  the target each, the lane pending * its seconds per token.
A pure function of numbers, so its choices are unit-tested (tests/test_prefill_lane.py); LaneSteps asks it before
each step it plans.
"""

from __future__ import annotations

FIGURE_TTL_S = 2.0  # how long a decode step's time beside the lane may keep the lane passed over


def lane_pays(pending_tokens: int, cap_tokens: int | None, target_s: float | None, lane_token_s: float,
              lane_step_s: float, lane_step_age_s: float = 0.0) -> bool:
    """Whether the `pending_tokens` prompt tokens waiting should go to the lane (see the module).
    `cap_tokens`: the prompt tokens a decoding step may carry under `target_s` (None / None: no target);
    `lane_token_s`, `lane_step_s`: the lane's measured seconds per prompt token and decode step time beside it (0:
    not measured yet); `lane_step_age_s`: seconds since that step time was last measured."""
    if target_s is None or cap_tokens is None or lane_token_s <= 0 or lane_step_s <= 0:
        return True
    if lane_step_s > target_s:
        return lane_step_age_s > FIGURE_TTL_S  # a stale figure: measure it anew
    if pending_tokens <= 0:
        return True
    chunked_s = -(-pending_tokens // max(cap_tokens, 1)) * target_s
    return pending_tokens * lane_token_s < chunked_s
