"""Stragglers: finds a worker that steps much slower than its peers on the same shape of work, and replaces it.

Owns the step-time window of every live worker and the verdicts. Each stats period (`observe`, after the
liveness probe refreshed every worker's EngineLoad) a worker's new steps since its last report become one sample:
its steps, their summed host time, and its batch shape, the power-of-two bucket of tokens per step (1, 2-3, 4-7,
...). Over the last `stragglers.window_s`, per worker and bucket: steps and mean step time. A worker's ratio is
its mean step time over the median of its same-role peers' in each bucket both have at least `min_steps` steps in,
weighted by its steps there, counting only what happened since the youngest of them was first seen (a replacement's
peers took its share of the load while it restarted: their slower steps then are no verdict on them); over `factor`
it is a straggler: logged once per incarnation, counted (`detected`), shown per worker (`ratios`, `flagged`), and
with `replace` handed to `replace()`, which cycles it
(coordinator.backend.cycling: drained, its requests given `drain_timeout_s` to finish then moved, replaced, routed
to again). A replacement is a new incarnation with an empty window.

Handoffs are judged the same way: each decode worker's handoffs (kv_transfer + decode_join of its remote requests,
`handoff()`, from what the worker measured) over the window give its seconds per prompt token; over `factor` times
its peers' median (each with at least MIN_HANDOFFS handoffs in the window) it is a straggler too (a slow NIC, a
link that fell back from NVLink to TCP). Its ratio is the larger of the two (`ratios`).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from coordinator.admission.router import WorkerState
from coordinator.backend.cycling import CycleFailed, Cycler, CycleRefused
from coordinator.config.straggler_config import StragglerConfig

log = logging.getLogger("pdserve")
MIN_HANDOFFS = 5  # handoffs in the window, per side, before a worker's handoff time is compared


@dataclass(frozen=True)
class _Sample:
    at: float       # coordinator monotonic time it was taken
    steps: int
    seconds: float  # host time of those steps
    bucket: int     # (tokens per step) rounded, its bit length: 1 for 1, 2 for 2-3, 3 for 4-7, ...


class StragglerWatch:
    def __init__(self, config: StragglerConfig) -> None:
        self.config = config
        self._last: dict[str, tuple[int, float, int]] = {}  # worker key -> (steps, step seconds, tokens) totals
        self._samples: dict[str, deque[_Sample]] = {}       # worker key -> its samples within the window
        self.ratios: dict[str, float] = {}                  # worker name -> its step time over its peers' (last look)
        self.flagged: dict[str, str] = {}                   # worker name -> the key of the incarnation found slow
        self._handoffs: dict[str, deque[tuple[float, int, float]]] = {}  # worker key -> (at, tokens, seconds)
        self._first_seen: dict[str, float] = {}             # worker key -> when its first report was sampled
        self.detected = 0
        self.replaced = 0

    def handoff(self, worker: WorkerState, tokens: int, seconds: float, now: float) -> None:
        """Decode worker `worker` took a remote prefill's KV of `tokens` prompt tokens in `seconds` (worker-measured
        kv_transfer + decode_join)."""
        if tokens > 0 and seconds >= 0:
            self._handoffs.setdefault(worker.key, deque()).append((now, tokens, seconds))

    def observe(self, workers: Iterable[WorkerState], now: float) -> list[tuple[WorkerState, str]]:
        """Take a sample of every live worker; the stragglers newly found, each with why."""
        live = [w for w in workers if w.alive and w.load is not None]
        keys = {w.key for w in live}
        for gone in (set(self._last) | set(self._handoffs)) - keys:  # dead incarnations
            self._last.pop(gone, None)
            self._samples.pop(gone, None)
            self._handoffs.pop(gone, None)
        for gone in set(self._first_seen) - keys:
            del self._first_seen[gone]
        for w in live:
            self._sample(w, now)
        found = []
        for handoffs in self._handoffs.values():
            while handoffs and now - handoffs[0][0] > self.config.window_s:
                handoffs.popleft()
        for w in live:
            peers = [p for p in live if p.role == w.role and p is not w]
            since = max(self._first_seen[k.key] for k in (w, *peers))  # all of them seen from then on
            step, handoff = self._ratio(w, peers, since), self._handoff_ratio(w, peers, since)
            ratio = self.ratios[w.name] = max(step, handoff)
            if ratio > self.config.factor and self.flagged.get(w.name) != w.key:
                self.flagged[w.name] = w.key
                self.detected += 1
                what = "mean step time" if step >= handoff else "handoff time per prompt token"
                why = (f"straggler: its {what} is {ratio:.1f}x its {w.role} peers' over the last "
                       f"{self.config.window_s:g} s (stragglers.factor {self.config.factor:g})")
                log.warning("worker %s: %s%s", w.name, why, "; replacing it" if self.config.replace else "")
                found.append((w, why))
        return found

    def slow_now(self, name: str) -> bool:
        """Whether worker `name`'s last look found it over the factor."""
        return self.ratios.get(name, 0.0) > self.config.factor

    async def replace(self, cycler: Cycler, worker: WorkerState, why: str) -> None:
        """Drain and replace straggler `worker` (never the last worker of its pool: that is logged instead)."""
        name = worker.name
        try:
            await cycler.cycle(name, why, self.config.drain_timeout_s, key=worker.key)
        except (CycleRefused, CycleFailed) as e:
            log.error("worker %s is a straggler but was not replaced: %s", name, e)
            return
        self.replaced += 1

    def _sample(self, w: WorkerState, now: float) -> None:
        load = w.load
        totals = (load.steps, load.step_time_total_s, load.scheduled_tokens_total)
        last = self._last.get(w.key)
        self._last[w.key] = totals
        self._first_seen.setdefault(w.key, now)
        samples = self._samples.setdefault(w.key, deque())
        while samples and now - samples[0].at > self.config.window_s:
            samples.popleft()
        if last is None or totals[0] <= last[0]:
            return
        steps = totals[0] - last[0]
        per_step = max(1, round((totals[2] - last[2]) / steps))
        samples.append(_Sample(now, steps, max(0.0, totals[1] - last[1]), per_step.bit_length()))

    def _buckets(self, w: WorkerState, since: float) -> dict[int, tuple[int, float]]:
        """bucket -> (steps, mean step seconds) within the window and after `since`, buckets with at least min_steps
        steps only."""
        sums: dict[int, list[float]] = {}
        for s in self._samples.get(w.key, ()):
            if s.at <= since:  # the sample covers steps from before `since`
                continue
            acc = sums.setdefault(s.bucket, [0, 0.0])
            acc[0] += s.steps
            acc[1] += s.seconds
        return {b: (int(n), t / n) for b, (n, t) in sums.items() if n >= self.config.min_steps}

    def _ratio(self, w: WorkerState, peers: list[WorkerState], since: float) -> float:
        """w's step time over its peers' median, weighted by w's steps per shared bucket (steps after `since`);
        0.0 with nothing shared."""
        mine = self._buckets(w, since)
        theirs = [self._buckets(p, since) for p in peers]
        weighted, steps = 0.0, 0
        for bucket, (n, mean) in mine.items():
            peer_means = [b[bucket][1] for b in theirs if bucket in b]
            if peer_means and statistics.median(peer_means) > 0:
                weighted += n * mean / statistics.median(peer_means)
                steps += n
        return weighted / steps if steps else 0.0

    def _handoff_ratio(self, w: WorkerState, peers: list[WorkerState], since: float) -> float:
        """w's handoff seconds per token over its peers' median (each with MIN_HANDOFFS in the window after
        `since`); 0.0 if not."""
        def rate(key: str) -> float | None:
            handoffs = [h for h in self._handoffs.get(key, ()) if h[0] > since]
            tokens = sum(t for _, t, _ in handoffs)
            return sum(s for _, _, s in handoffs) / tokens if len(handoffs) >= MIN_HANDOFFS and tokens else None
        mine, theirs = rate(w.key), [r for p in peers if (r := rate(p.key)) is not None]
        if mine is None or not theirs or statistics.median(theirs) <= 0:
            return 0.0
        return mine / statistics.median(theirs)
