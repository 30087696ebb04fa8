"""PlacementModel: where an adaptive request's prompt is prefilled (`mode: adaptive`): remotely, on a worker that
takes prefills for others, its KV then handed over to the worker that decodes it; or locally, on that decode
worker itself, chunked into its decode steps within their budget (engine.core.step_budget) so that its running
streams keep their time-per-token target.

The choice is a cost model of each side's time to the first token, from figures measured while serving:
- each worker's seconds per prompt token and per decode step, and the prompt tokens a decoding step may carry
  (its EngineLoad, reported with every step: the engine measures them on its own steps);
- the prompt tokens already queued on it (the ledger's bookings: exact, they are what the coordinator sent);
- the handoff's seconds per prompt token (kv_transfer phases of earlier remote requests: `observe_transfer`);
- the prompt's tokens that each side's prefix cache likely holds already (the router's prefix owners);
- a decoding worker with a prefill lane (EngineConfig.sm_split_decode_sms) prefills beside its steps, not in them:
  at the lane's measured seconds per prompt token (EngineLoad.lane_token_s), once it has one and while its split
  table takes prompts beside its decode batch (a table row of 0 SMs chunks them: the load then reports 0).
A worker that decodes nothing prefills at its full rate; one that decodes gets only its step budget's share, and
none at all while its decode steps leave no room under the target (its budget is then the engine's floor). A
remote prefill keeps the prompt off the decode worker's steps entirely, so it wins whenever it meets the TTFT
target comfortably (REMOTE_COMFORT of it); otherwise the side with the earlier first token wins. Without a worker
that takes remote prefills, or without any measurement yet of a remote worker, the rule still answers.
Each estimate is then scaled by what that worker's side has measured against its raw estimates so far
(coordinator.admission.calibration: `observe_first_token` teaches it each placement's measured first token).
Only numbers go in; the model calls no worker and books nothing (coordinator.admission.admission does).
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.admission.calibration import EstimateCalibration
from coordinator.config.adaptive_config import SLOConfig
from engine.load import EngineLoad

REMOTE_COMFORT = 0.5  # a remote prefill whose first token is due within this share of the TTFT target is taken
EWMA = 0.2


@dataclass(frozen=True)
class Side:
    """One place a prompt could be prefilled, as the model sees it."""

    name: str
    load: EngineLoad | None  # the worker's last report
    queued_tokens: int       # prompt tokens booked on it and not yet prefilled
    new_tokens: int          # this prompt's tokens its prefix cache likely lacks
    decoding: bool           # it runs decodes: prompts share its steps within their budget


@dataclass(frozen=True)
class Choice:
    remote: Side | None      # None: prefill locally
    local_s: float           # the calibrated estimates it was made on (inf: unknown)
    remote_s: float
    local: str = ""          # the decode worker (the local side)
    raw_s: float = float("inf")  # the chosen side's estimate before calibration: what its first token teaches

    @property
    def placement(self) -> str:
        return "local" if self.remote is None else "remote"

    @property
    def worker(self) -> str:
        """The worker that prefills it."""
        return self.local if self.remote is None else self.remote.name


class PlacementModel:
    def __init__(self, slo: SLOConfig) -> None:
        self.slo = slo
        self.transfer_s_per_token = 0.0  # a handoff's seconds per prompt token, as measured
        self.calibration = EstimateCalibration()

    def observe_transfer(self, tokens: int, seconds: float) -> None:
        """A remote request's measured handoff (its kv_transfer phase) for `tokens` prompt tokens."""
        if tokens > 0 and seconds >= 0:
            self.transfer_s_per_token = (1 - EWMA) * self.transfer_s_per_token + EWMA * seconds / tokens

    def observe_first_token(self, choice: Choice, seconds: float) -> None:
        """The request placed by `choice` had its first token `seconds` after it was placed."""
        self.calibration.observe(choice.worker, choice.placement, choice.raw_s, seconds)

    def first_token_s(self, side: Side, per_token_fallback: float) -> float:
        """Seconds until `side` has computed its queue and this prompt (inf if it has no figures at all)."""
        load = side.load
        per_token = load.prefill_token_s if load is not None and load.prefill_token_s > 0 else per_token_fallback
        if per_token <= 0:
            return float("inf")
        tokens = side.queued_tokens + side.new_tokens
        if not side.decoding or load is None:
            return tokens * per_token
        if load.lane_token_s > 0:  # a prefill lane: prompts run beside its decode steps, at the lane's own rate
            return tokens * load.lane_token_s
        budget = max(load.prefill_budget_tokens, 1)  # prompt tokens per decoding step
        step_s = load.decode_step_s + budget * per_token
        if step_s > self.slo.decode_step_target_s:  # no headroom: its budget is the floor, which only keeps
            return float("inf")                      # prompts placed there before moving; no new one goes there
        return -(-tokens // budget) * step_s

    def choose(self, local: Side, remotes: list[Side]) -> Choice:
        """Where to prefill: the best remote side or the local one (see the module's rule)."""
        per_token = _fallback([local, *remotes])
        local_raw = self.first_token_s(local, per_token)
        local_s = self.calibration.scaled(local.name, "local", local_raw)
        if not remotes:
            return Choice(None, local_s, float("inf"), local.name, local_raw)
        raw = [(self.first_token_s(side, per_token) + side.new_tokens * self.transfer_s_per_token, side)
               for side in remotes]
        best_s, best_raw, best = min(((self.calibration.scaled(side.name, "remote", r), r, side) for r, side in raw),
                                     key=lambda t: t[0])
        if best_s <= REMOTE_COMFORT * self.slo.ttft_s or best_s <= local_s:
            return Choice(best, local_s, best_s, local.name, best_raw)
        return Choice(None, local_s, best_s, local.name, local_raw)


def _fallback(sides: list[Side]) -> float:
    """Seconds per prompt token for a worker that has measured none yet: the slowest any worker measured (or 0)."""
    measured = [s.load.prefill_token_s for s in sides if s.load is not None and s.load.prefill_token_s > 0]
    return max(measured, default=0.0)
