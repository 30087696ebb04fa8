"""EngineSteps: LLMEngine's step() and what it runs, a mixin (engine.llm_engine builds the state it reads).

step() = schedule, run, update. With overlapped steps (EngineConfig.async_scheduling) step() queues the next step on
the device before it waits for the one in flight (`_overlapped_step`), so a step's tokens come out of the step() call
after the one that launched it. A step's prompt chunks may instead go to a prefill lane (engine.lane_steps). Each
step's host time, and what it carried, teach the step budget and the copy-cost rates (engine.core.step_budget,
engine.core.copy_cost). The engine is not thread-safe: one loop owns it and calls step().
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerOutput, StepOutput
from engine.runner.model_runner import LaunchedStep
from engine.runner.step_extras import plan_extras, record_extras, with_extras

if TYPE_CHECKING:
    pass

LayerHook = Callable[[SchedulerOutput], Callable[[int], None] | None]  # see EngineSteps.step


class EngineSteps:
    def step(self, layer_hook: LayerHook | None = None) -> list[StepOutput]:
        """One step. `layer_hook(sched)`, called once the step is scheduled, may return a callback that runs after
        each layer has written its K/V (layer-wise KV pushes: prefill_pool.kv_push); such a step runs eagerly."""
        start = time.perf_counter()
        try:
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            if self._tier_build is not None:
                self._attach_host_tier()
            return self._step(layer_hook)
        finally:
            self.num_steps += 1
            self.step_time_last_s = time.perf_counter() - start
            self.step_time_total_s += self.step_time_last_s
            if self.step_budget is not None and self._applied is not None:
                self.step_budget.observe(*self._applied, self.step_time_last_s)
                if self.lane is None:  # a lane takes a step's prompts whole: they do not ride in the steps
                    self.scheduler.prefill_cap = self.step_budget.tokens
            if self._applied is not None and (self.swap_space is not None or self.host_tier is not None):
                self.copy_cost.observe_prefill(self._applied[1], self.step_time_last_s)  # a recompute's cost
            self._applied = None

    def _step(self, layer_hook: LayerHook | None) -> list[StepOutput]:
        outputs = [StepOutput(rid, [], [], "expired", prefill_only=True) for rid in self.scheduler.expired_pins()
                   if self.scheduler.finish(rid, "expired")]
        self.num_expired_pins += len(outputs)
        outputs += self._admit_held()
        if self._held and not self.scheduler.has_work and self._in_flight is None:  # only held requests wait
            return outputs
        if self._in_flight is not None:  # a lane engine lets schedule() plan a waiting prompt (engine.lane_steps)
            may_continue = layer_hook is None and not (self.lane is not None and self._prompts_pending())
            if may_continue:
                self._plan_lane()  # the cap of prompt tokens a lane engine chunks into the steps it plans ahead
            return outputs + self._overlapped_step(may_continue)
        outputs += self._lane_finish()
        self._plan_lane()
        sched = self.scheduler.schedule()
        on_layer_done = layer_hook(sched) if layer_hook is not None and sched.chunks else None
        self._move_swapped(sched)
        if on_layer_done is None and self._lane_takes(sched):
            return outputs + self._lane_step(sched)
        launched = self.runner.launch(sched, self._params(sched), on_layer_done=on_layer_done,
                                      extras=plan_extras(sched, self.scheduler.requests))
        if self.overlap and on_layer_done is None and sched.chunks and not self.scheduler.plans_alone(sched):
            self._in_flight = launched  # applied by the next step(), after it queued the step that follows
            return outputs
        return outputs + self._apply(launched)

    def _overlapped_step(self, may_continue: bool) -> list[StepOutput]:
        """Queue the step after the one in flight (Scheduler.schedule_after: unless only schedule() may plan it),
        then wait for the one in flight and apply its tokens."""
        current, self._in_flight = self._in_flight, None
        nxt = self.scheduler.schedule_after(current.sched) if may_continue else None
        if nxt is not None:
            self._move_swapped(nxt)
            self._in_flight = self.runner.launch(nxt, self._params(nxt), after=current)
        return self._apply(current)

    def _apply(self, launched: LaunchedStep) -> list[StepOutput]:
        sampled = launched.result()
        if self.step_budget is not None or self.swap_space is not None or self.host_tier is not None:
            # what the step step() times carried
            chunks = launched.sched.chunks
            decodes = sum(1 for c in chunks if len(c.token_ids) == 1 and c.output_index > 0)
            self._applied = (decodes, launched.sched.num_tokens - decodes)
        extra = record_extras(launched.sampling, launched.prompt_logprobs, launched.fork_first,
                              self.scheduler.requests)
        outputs = self.scheduler.update(launched.sched, sampled, self.config.pin_lease_s)
        if extra:
            outputs = [with_extras(o, extra[o.request_id]) if o.request_id in extra else o for o in outputs]
        if self.grammar is None:
            return outputs
        return self.grammar.after_update(outputs, self.scheduler.requests, self.scheduler.finish)

    def _params(self, sched: SchedulerOutput) -> dict[str, SamplingParams]:
        return {c.request_id: self.scheduler.requests[c.request_id].params for c in sched.chunks}

    def capture_deferred_graph(self, busy: bool) -> bool:
        """Between two steps: capture one of the graphs left for after start, if any are left and, when `busy`
        (requests are running), the last capture was long enough ago (engine.runner.deferred_graphs). Returns
        whether it captured one."""
        return self.deferred_graphs is not None and self.deferred_graphs.capture_one(busy)

    def has_unfinished(self) -> bool:
        """Requests wait or run. A step in flight whose requests all ended since is left to the next step() to
        drop: its device work only touches their freed blocks, before anything queued later."""
        return self.scheduler.has_work or bool(self._held)
