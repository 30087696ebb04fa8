"""LaneSteps: LLMEngine's steps with a prefill lane (EngineConfig.sm_split_decode_sms; issue 43), a mixin.

A step whose plan has prompt chunks and decode rows hands the prompt chunks to the lane (engine.runner.prefill_lane)
and runs the decode rows on the decode lane; until the lane's job is applied the scheduler holds its requests
(Scheduler.held: no step plans prompt tokens, none of them is preempted), so the steps in between are decode-only,
on the decode lane. The job is applied at the start of the first step after it is done (or, when nothing else runs,
waited for). Steps the lane does not take run as without it: prompt-only steps (no stream to protect), steps with
prompt logprobs or parallel samples (engine.runner.step_extras), steps with a per-layer hook (KV pushes), and
decode-only steps while the lane is idle (these keep overlapped scheduling; LLMEngine stops overlapping when a
prompt waits, so that schedule() plans it here), steps beside as many decoding rows as the split table gives 0 SMs
(engine.lane_splits: chunked there), and, with a decode step target (the StepBudget), steps whose
prompts engine.core.lane_policy finds quicker chunked under the budget. The lane's figures (its seconds per prompt
token, a decode step's time beside a job) are its own; neither its jobs nor the steps beside them teach the
StepBudget.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from engine.core.lane_policy import lane_pays
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerOutput, StepOutput
from engine.engine_config import EngineConfig
from engine.lane_splits import split_table
from engine.runner.prefill_lane import PrefillLane
from engine.runner.step_extras import plan_extras

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler

ENDED = SamplingParams(temperature=0, max_tokens=1)  # the row of a request that ended while on the lane


class LaneSteps:
    lane: PrefillLane | None
    lane_on: bool = True  # whether this step's prompts may go to the lane (set by _plan_lane)
    scheduler: Scheduler

    def _prefill_lane(self, config: EngineConfig) -> PrefillLane | None:
        """The lane sm_split_decode_sms asks for (None: off); ValueError naming the key where it cannot run."""
        table = split_table(config.sm_split_decode_sms)
        if not table:
            return None
        make_lanes = None
        if self.device.type == "cuda":
            from engine.runner.sm_lanes import available, split_sms

            why = available(self.device)
            if why:
                raise ValueError(f"EngineConfig.sm_split_decode_sms {config.sm_split_decode_sms}: {why}")
            device, total = self.device, torch.cuda.get_device_properties(self.device).multi_processor_count

            def make_lanes(decode_sms: int):
                if decode_sms >= total:
                    raise ValueError(f"EngineConfig.sm_split_decode_sms {config.sm_split_decode_sms}: a decode lane "
                                     f"of {decode_sms} SMs leaves none of this GPU's {total} to the prefill lane")
                try:
                    return split_sms(device, decode_sms)
                except RuntimeError as e:
                    raise ValueError(f"EngineConfig.sm_split_decode_sms {config.sm_split_decode_sms}: {e}") from None
        return PrefillLane(self.runner, table, make_lanes, config.max_num_seqs, self.max_blocks_per_seq)

    def _prompts_pending(self) -> bool:
        """Whether a prompt waits to be planned beside a decode batch the lane takes (then a lane engine stops
        overlapping: schedule() plans it)."""
        s = self.scheduler
        return (bool(s.waiting) or any(r.num_pending_tokens > 1 for r in s.running)) and self.lane.takes(
            self._decoding_rows())

    def _decoding_rows(self) -> int:
        return sum(1 for r in self.scheduler.running if r.num_pending_tokens <= 1)

    def _lane_finish(self) -> list[StepOutput]:
        """Apply the lane's job if it is done."""
        if self.lane is None or not self.lane.ready():
            return []
        sched, requests = self.lane.job.sched, self.scheduler.requests
        # a request aborted meanwhile (its id maybe taken again since) still has its row sampled (greedy), and
        # update() then skips it
        params = {c.request_id: requests[c.request_id].params if c.request_id in requests
                  and requests[c.request_id].incarnation == c.incarnation else ENDED for c in sched.chunks}
        launched = self.lane.finish(params)
        self.scheduler.held.clear()
        outputs = self._apply(launched)
        self._applied = None  # its prompt ran beside the steps: no step's time is its cost (StepBudget, SwapSpace)
        return outputs

    def _plan_lane(self) -> None:
        """Before a step is planned: whether prompts may go to the lane now (engine.core.lane_policy), and so
        whether the step budget caps the prompt tokens of the step (it does when they are chunked into it)."""
        if self.lane is None:
            return
        s, b = self.scheduler, self.step_budget
        pending = sum(r.num_pending_tokens for r in s.waiting) + sum(
            r.num_pending_tokens for r in s.running if r.num_pending_tokens > 1)
        self.lane_on = self.lane.busy or self.lane.takes(self._decoding_rows()) and lane_pays(
            pending, b.tokens if b else None, b.target_s if b else None, self.lane.token_s, self.lane.step_s,
            time.perf_counter() - self.lane.step_at)
        s.prefill_cap = None if self.lane_on or b is None else b.tokens

    def _lane_takes(self, sched: SchedulerOutput) -> bool:
        if self.lane is None:
            return False
        if self.lane.busy:
            return True
        if not self.lane_on:  # chunked this step (lane_pays)
            return False
        has_prompt = any(len(c.token_ids) > 1 for c in sched.chunks)
        decode_rows = sum(1 for c in sched.chunks if len(c.token_ids) == 1)
        return (has_prompt and decode_rows > 0 and self.lane.takes(decode_rows)
                and not plan_extras(sched, self.scheduler.requests))

    def _lane_step(self, sched: SchedulerOutput) -> list[StepOutput]:
        """Run `sched` (which _lane_takes) with the lane; its KV copies are queued already."""
        prompt = [c for c in sched.chunks if len(c.token_ids) > 1]
        decode = [c for c in sched.chunks if len(c.token_ids) == 1]
        if prompt:  # the lane is idle: held requests leave no prompt tokens to plan
            self.scheduler.held.update(c.request_id for c in prompt)
            self.lane.start(SchedulerOutput(chunks=prompt), len(decode))
        if decode:
            began = time.perf_counter()
            outputs = self._apply(self.lane.launch_decode(SchedulerOutput(chunks=decode),
                                                          self._params(SchedulerOutput(chunks=decode))))
            if self.lane.busy:  # beside a job its time is the lane's figure, not the step budget's
                self._applied = None
                if not prompt:  # (the step that queued the job also paid for queueing it)
                    self.lane.observe_step(time.perf_counter() - began)
            return outputs
        self.lane.wait()  # nothing else runs: the job's tokens are next
        return self._lane_finish()
