"""Per-request phase tracing: where one request's wall time went, as the coordinator sees it.

PHASES, in a request's order:
- `ingress`: arrival at the HTTP handler -> the backend stream opens (body read, validation, tokenization, tenant
  limits);
- `admission`: waiting for a placement (room for its KV, a prefill backlog under its cap, a live worker);
- `prefill_queue`: on the worker that prefills it, from the call's arrival to the first engine step that runs it
  (waiting for the engine loop and behind other prompts), worker-measured;
- `kv_restore`: of that, the copies of the prompt's prefix back from the worker's host tier (engine.core.host_tier)
  ahead of its first step, worker-measured; only requests that restored blocks have it;
- `prefill_compute`: that first step -> its first token out (every chunk of a chunked prefill; less kv_restore),
  worker-measured;
- `kv_transfer`: the decode worker reserving blocks and pulling the KV, worker-measured; for a pushed handoff
  (prefill_pool.kv_push: written during the forward) the prefill worker's wait for its last writes after the
  forward, plus the decode worker taking its booking;
- `decode_join`: the KV landed -> the first decode-engine step that runs the request (the step in flight ends first),
  worker-measured;
- `first_decode_step`: that step, until its token is out, worker-measured;
- `decode`: the first token from the decode stream reaching the coordinator -> the last one;
- `migration`: what an attempt lost when its worker died: from its last boundary to the coordinator learning of it;
- `overhead`: the rest: Ray calls and output-stream hops around the worker-measured phases, the coordinator's work
  between them, and the tail after the last token (the usage chunk; in the histograms, until the request's close).

The sum identity holds by construction. A PhaseTrace has one cursor on the coordinator's clock (time.monotonic),
starting at the request's arrival. `mark(phase)` gives the time since the cursor to `phase` and moves the cursor to
now; `split(parts)` closes the interval since the cursor with worker-measured durations (only durations cross
machines, never timestamps), each clamped into what is left of the interval, in order, the remainder to `overhead`;
`snapshot()` and `finish()` give the still open interval to `overhead`. So the phases always partition
[arrival, now]: they sum to the end-to-end latency the coordinator measures, whatever the workers' clocks say.

Which phases a request has. Disaggregated: ingress, admission, prefill_queue, prefill_compute, kv_transfer,
decode_join, first_decode_step, decode, overhead. Collocated (DISAGGREGATED_ONLY do not apply): ingress, admission,
prefill_queue, prefill_compute, decode, overhead; kv_restore joins either where a prefix came back from the host
tier (RESTORE_ONLY); its first decode step is an ordinary step of the running batch, in
`decode`. A request whose first token ends it has no decode phases; a request that ends before its placement has
only ingress, admission and overhead. A failed KV pull that the decode worker recomputes: the failed pull is
overhead, the recompute adds to prefill_queue and prefill_compute.
Migrations: phases add up over a request's attempts. A moved request's second admission adds to `admission`, its
re-prefill (prompt + tokens already sent) to prefill_queue / prefill_compute, and so on; the interval the dead
attempt lost is `migration`. The sum identity is untouched, since every interval still goes to exactly one phase.

Scope: single-choice requests (ServingBackend.generate). Requests on the choices path (n > 1, best_of, prompt lists,
echo, prompt_logprobs) are not traced: no phase histogram samples, and `stream_options.include_phases` is a 400.
A backend that records no phases (the tests' in-process engine) leaves everything after ingress in `overhead`.
Besides the sums, a trace keeps its intervals in order (phase, start, end; consecutive ones of one phase merged, at
most MAX_INTERVALS) and a few attributes its backend notes (its workers, its placement): what the request's
OpenTelemetry spans are made of (coordinator.observability.tracing).
Exported as the histogram `pdserve_request_phase_seconds{phase}` (coordinator.observability.metrics; every phase a
request has,
observed once when it ends, whatever its outcome) and, when the client asks (`stream_options.include_phases`), as
`phases` on the stream's final usage chunk.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

PHASES = ("ingress", "admission", "prefill_queue", "kv_restore", "prefill_compute", "kv_transfer", "decode_join",
          "first_decode_step", "decode", "migration", "overhead")
DISAGGREGATED_ONLY = ("kv_transfer", "decode_join", "first_decode_step")
RESTORE_ONLY = ("kv_restore",)  # only requests that restored a prefix from the host tier
REMAINDER = "overhead"
WIRE_DIGITS = 6  # seconds on the usage chunk, to the microsecond
MAX_INTERVALS = 256  # a trace keeps at most this many intervals (a request moved many times); the sums stay whole
Interval = tuple[str, float, float]  # (phase, start, end), time.monotonic() seconds
TraceState = tuple[float, dict[str, float], float, list[Interval], dict[str, str]]


class PhaseTrace:
    """One request's phases: seconds per phase, partitioning [start, cursor]; one task or event loop marks it."""

    def __init__(self, start: float) -> None:
        self.start = start          # time.monotonic() at arrival
        self._cursor = start
        self._seconds: dict[str, float] = {}
        self._final: dict[str, float] | None = None
        self._intervals: list[Interval] = []
        self.attributes: dict[str, str] = {}  # what the backend noted (workers, placement), for the spans

    @classmethod
    def now(cls) -> PhaseTrace:
        return cls(time.monotonic())

    def mark(self, phase: str, now: float | None = None) -> None:
        """The time since the previous boundary was `phase`; `now` becomes the boundary."""
        now = self._clamp(now)
        self._add(phase, self._cursor, now)
        self._cursor = now

    def split(self, parts: Iterable[tuple[str, float]], now: float | None = None) -> None:
        """Close the interval since the previous boundary with worker-measured durations, in order: each gets at
        most what is left of the interval (a negative or NaN one counts as 0), the remainder is overhead."""
        now = self._clamp(now)
        at = self._cursor
        for phase, seconds in parts:
            take = min(seconds, now - at) if seconds > 0 else 0.0  # NaN > 0 is False
            self._add(phase, at, at + take)
            at += take
        self._add(REMAINDER, at, now)
        self._cursor = now

    def snapshot(self, now: float | None = None) -> dict[str, float]:
        """Seconds per phase up to `now`, the open interval as overhead (the trace itself is not changed)."""
        if self._final is not None:
            return dict(self._final)
        out = dict(self._seconds)
        out[REMAINDER] = out.get(REMAINDER, 0.0) + self._clamp(now) - self._cursor
        return out

    def finish(self, now: float | None = None) -> dict[str, float]:
        """The final phases (the open interval as overhead); later marks change nothing. Idempotent."""
        if self._final is None:
            now = self._clamp(now)
            self._add(REMAINDER, self._cursor, now)
            self._cursor = now
            self._final = dict(self._seconds)
        return dict(self._final)

    def intervals(self) -> list[Interval]:
        """The phases' intervals in order, partitioning [start, cursor] (after finish(): [start, end])."""
        return list(self._intervals)

    def state(self) -> TraceState:
        """What another process needs to go on with this trace: start, seconds per phase, cursor, intervals,
        attributes."""
        return self.start, dict(self._seconds), self._cursor, list(self._intervals), dict(self.attributes)

    @classmethod
    def restored(cls, state: TraceState) -> PhaseTrace:
        trace = cls(state[0])
        trace.adopt(state)
        return trace

    def adopt(self, state: TraceState) -> None:
        """Take over another process's copy of this trace (it went on marking it): its phases and cursor. Both
        read the same clock (time.monotonic is system-wide on a host). A finished trace does not change."""
        if self._final is None and state[2] >= self._cursor:
            self._seconds, self._cursor = dict(state[1]), state[2]
            self._intervals, self.attributes = list(state[3]), dict(state[4])

    def _add(self, phase: str, start: float, end: float) -> None:
        if self._final is not None:
            return
        self._seconds[phase] = self._seconds.get(phase, 0.0) + (end - start)
        if end <= start:
            return
        last = self._intervals[-1] if self._intervals else None
        if last is not None and last[0] == phase and last[2] == start:
            self._intervals[-1] = (phase, last[1], end)
        elif len(self._intervals) < MAX_INTERVALS:
            self._intervals.append((phase, start, end))

    def _clamp(self, now: float | None) -> float:
        return max(time.monotonic() if now is None else now, self._cursor)


def wire(phases: dict[str, float]) -> dict[str, float]:
    """The phases as the usage chunk carries them: seconds rounded to the microsecond, in PHASES order."""
    return {p: round(phases[p], WIRE_DIGITS) for p in PHASES if p in phases}
