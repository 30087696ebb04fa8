"""How a worker's decode duty delivers what its engine makes (decode_pool.decodes.Decodes' mixin): each step's deltas
written to the coordinator's stream from the engine thread (`stream_step`), or, without a stream, kept in an outbox
that `poll` drains; the load sent with them, right after a free outside a step (`report_load`) and every
LOAD_REFRESH_S while idle (`keep_load_fresh`); and, beside each request's first output, its phase durations here.

Expects of the class it is mixed into: `stream` (WorkerStream or None), `step_load`, `_reported`, `_load`, `_timing`
(RequestTiming), `_phases`, `_outbox`, `_outbox_ready`, `_stream_sent_at` and `_group_prefills`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from decode_pool.step_delta import StepDelta
from engine.core.request_timing import Durations, RequestTiming
from engine.core.scheduler import StepOutput
from engine.load import EngineLoad

if TYPE_CHECKING:
    from decode_pool.worker_stream import WorkerStream

LOAD_REFRESH_S = 0.5  # with an output stream, an idle worker still reports its load this often


class DecodeOutputs:
    stream: WorkerStream | None
    step_load: EngineLoad | None
    _reported: Callable[[EngineLoad], EngineLoad]
    _load: Callable[[], asyncio.Future]
    _timing: RequestTiming
    _phases: dict[str, Durations]
    _outbox: list[StepOutput]
    _outbox_ready: asyncio.Event
    _stream_sent_at: float
    _group_prefills: dict[str, asyncio.Future]

    async def poll(self, timeout_s: float) -> tuple[list[tuple], EngineLoad, dict[str, Durations]]:
        """Every delta since the last poll (waits up to timeout_s for one), as plain tuples (decode_pool.step_delta:
        `StepDelta(*t)` reads them), the load as of their last step (asking the loop now would hold the deltas back
        until the step under way ends) or, with none, now, and the phase durations here of the timed requests whose
        first output is among those deltas."""
        if not self._outbox:
            try:
                await asyncio.wait_for(self._outbox_ready.wait(), timeout_s)
            except TimeoutError:
                pass
        out, self._outbox = self._outbox, []
        phases, self._phases = self._phases, {}
        self._outbox_ready.clear()
        load = self.step_load if out and self.step_load is not None else await self._load()
        return StepDelta.wire(out), load, phases

    async def report_load(self) -> None:
        """Blocks were freed outside a step (an abort): the coordinator gets the load now, not with the next step or
        LOAD_REFRESH_S later (vllm:kv_cache_usage_perc kept an aborted stream's blocks for up to a second)."""
        if self.stream is not None:
            self.stream.send(([], await self._load(), {}, {}))
            self._stream_sent_at = time.monotonic()
        else:
            self._outbox_ready.set()  # the long-poll returns now, with the load as of now

    def takes(self, out: StepOutput) -> bool:
        """Whether a step output is this duty's to deliver: every output but other workers' prefills' (a local
        group prefill's first tokens resolve its prefill_group here)."""
        return not out.prefill_only or out.request_id in self._group_prefills

    def stream_step(self, outputs: list[StepOutput], load: EngineLoad) -> None:
        """On the engine thread, after each step: the step's deltas onto the output stream at once, not through the
        event loop (prefills' first tokens, a local group prefill's included, go to the event loop: on_outputs)."""
        self.step_load = self._reported(load)
        deltas = [o for o in outputs if not o.prefill_only]
        if deltas:
            self.stream.send((StepDelta.wire(deltas), self.step_load, self._first_phases(deltas), {}))
            self._stream_sent_at = time.monotonic()

    def on_outputs(self, outputs: list[StepOutput], load: EngineLoad) -> None:
        """On the event loop: with a stream, only local group prefills' first outputs; without, every delta."""
        if self.stream is None:
            self.step_load = self._reported(load)  # taken on the engine thread right after the step
        rest = []
        for out in outputs:
            future = self._group_prefills.pop(out.request_id, None) if out.prefill_only else None
            if future is None:
                rest.append(out)
            elif not future.done():
                future.set_result(out)
        if self.stream is None:
            self._push([o for o in rest if not o.prefill_only])

    async def keep_load_fresh(self) -> None:
        """With a stream: an idle worker's load reaches the coordinator every LOAD_REFRESH_S all the same (the
        long-poll returned it on its timeout)."""
        while True:
            await asyncio.sleep(LOAD_REFRESH_S)
            if time.monotonic() - self._stream_sent_at >= LOAD_REFRESH_S:
                self.stream.send(([], await self._load(), {}, {}))
                self._stream_sent_at = time.monotonic()

    def _push(self, outputs: list[StepOutput]) -> None:
        """Outputs made off the engine's steps (a request ended as it joined) or, without a stream, every step's."""
        if self.stream is not None:
            if outputs:
                self.stream.send((StepDelta.wire(outputs), self.step_load, self._first_phases(outputs), {}))
                self._stream_sent_at = time.monotonic()
            return
        self._phases.update(self._first_phases(outputs))
        self._outbox.extend(outputs)
        self._outbox_ready.set()

    def _first_phases(self, outputs: list[StepOutput]) -> dict[str, Durations]:
        """The phase durations of the timed requests whose first output is among `outputs` (each ends its entry)."""
        phases = {}
        if self._timing:
            for out in outputs:
                durations = self._timing.first_output(out.request_id)
                if durations is not None:
                    phases[out.request_id] = durations
        return phases
