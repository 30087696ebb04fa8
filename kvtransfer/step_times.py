"""`StepTimes`: seconds per named step of one operation that can be slow on a GPU host (a KV agent's start, a
peer's connection), in the order the steps ran, for the one log line that says where its time went
(pool_worker.worker: `agent steps: ...`, `add_peer ... steps: ...`).

Steps may be recorded from several threads (the caller's and the agent's loop thread), one after the other: a plain
list append each. A step that ran more than once (a handshake tried again) is listed each time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StepTimes:
    def __init__(self) -> None:
        self.steps: list[tuple[str, float]] = []

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        """Time the body as step `name` (recorded also when it raises)."""
        began = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - began)

    def add(self, name: str, seconds: float) -> None:
        self.steps.append((name, seconds))

    def extend(self, other: StepTimes, prefix: str = "") -> None:
        """Append `other`'s steps, each name prefixed with `prefix`."""
        self.steps += [(prefix + name, s) for name, s in other.steps]

    @property
    def total_s(self) -> float:
        return sum(s for _, s in self.steps)

    def __str__(self) -> str:
        return ", ".join(f"{name} {s:.3f} s" for name, s in self.steps) or "none"


@contextmanager
def maybe_step(steps: StepTimes | None, name: str) -> Iterator[None]:
    """`steps.step(name)`, or nothing where no one is timing (steps is None)."""
    if steps is None:
        yield
        return
    with steps.step(name):
        yield
