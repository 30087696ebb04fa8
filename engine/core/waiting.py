"""WaitingQueue and the preemption policy: the order in which the scheduler starts waiting requests, who may pass a
head that does not fit, and which running request gives its blocks back when they run out.

Order: lower priority number first, arrival order within a priority; a preempted request goes back to the very
front (it was admitted already). The same rules as the coordinator's queue (coordinator.admission.admission_queue):
- No head-of-line blocking: when the head does not fit for lack of KV blocks, requests of its priority behind it
  (up to BYPASS_SCAN of them, in order) may start if they fit, for `bypass_steps` engine steps after the head first
  did not fit. A request of a worse priority never passes a better one.
- No starvation: once the head has waited `bypass_steps` steps, nobody passes it: what frees stays free until it
  fits (a reservation for the head). A preempted head is never passed (letting new requests take the blocks it had
  would only preempt more). `bypass_steps` 0 is strict head of line.
Preemption: the victim is the running request of the worst priority, the most recently started within it
(`victim`), so a request never loses its blocks to one of a worse priority.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

from engine.core.request import Request

BYPASS_SCAN = 16  # requests behind a head that does not fit asked to start in its place, per step


class WaitingQueue:
    def __init__(self, bypass_steps: int) -> None:
        if isinstance(bypass_steps, bool) or not isinstance(bypass_steps, int) or bypass_steps < 0:
            raise ValueError(f"bypass_steps must be an integer >= 0, got {bypass_steps!r}")
        self.bypass_steps = bypass_steps
        self.num_bypassed = 0  # requests started ahead of a head that did not fit (since start, for metrics)
        self._queue: deque[Request] = deque()
        self._blocked: tuple[Request, int] | None = None  # the head that did not fit, and the step it first did not

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]

    def add(self, req: Request) -> None:
        """Behind every waiting request of its priority or a better one, ahead of worse ones."""
        at = len(self._queue)
        while at > 0 and self._queue[at - 1].priority > req.priority:
            at -= 1
        self._queue.insert(at, req)

    def push_front(self, req: Request) -> None:
        """A preempted request: first to start again."""
        self._queue.appendleft(req)

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def take(self, index: int) -> Request:
        """Remove and return the request at `index` (it starts now); index > 0 passed the head."""
        req = self._queue[index]
        del self._queue[index]
        if index:
            self.num_bypassed += 1
        return req

    def may_try(self, index: int) -> bool:
        """Whether the request at `index` may be asked to start while every one ahead of it waits: the head
        always; one behind it only within the scan and of the head's priority."""
        return index == 0 or (index <= BYPASS_SCAN and self._queue[index].priority == self._queue[0].priority)

    def head_blocked(self, step: int) -> bool:
        """The head did not fit at `step`: True if requests behind it may pass it now (see the module docstring)."""
        head = self._queue[0]
        if self._blocked is None or self._blocked[0] is not head:
            self._blocked = (head, step)
        return head.num_preemptions == 0 and step - self._blocked[1] < self.bypass_steps


def victim(running: Sequence[Request]) -> Request:
    """The running request to preempt: the worst priority (highest number), the most recently started within it."""
    return running[max(range(len(running)), key=lambda i: (running[i].priority, i))]
