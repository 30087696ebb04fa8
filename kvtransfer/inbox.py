"""`Inbox`: notifications received from peers ("request r: blocks ready", "released"), by sender name.

Filled from the agent's event-loop thread, drained by the owner from any thread. Bounded: a peer that
floods us cannot grow it without limit (the oldest messages of that peer are dropped and counted). An owner that
would rather be called than drain sets `listener`: each message then goes to listener(sender, msg) on the agent's
loop thread (which it must not block) instead of the queue.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class Inbox:
    def __init__(self, max_per_peer: int = 65536) -> None:
        self._max = max_per_peer
        self._msgs: dict[str, deque[bytes]] = {}
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.dropped = 0
        self.listener: Callable[[str, bytes], None] | None = None

    def put(self, sender: str, msg: bytes) -> None:
        listener = self.listener
        if listener is not None:
            listener(sender, msg)
            return
        with self._cond:
            q = self._msgs.setdefault(sender, deque())
            if len(q) >= self._max:
                q.popleft()
                self.dropped += 1
            q.append(msg)
            self._cond.notify_all()

    def drain(self) -> dict[str, list[bytes]]:
        """All messages received since the last drain, {sender: [msg, ...]} in arrival order."""
        with self._lock:
            out = {k: list(v) for k, v in self._msgs.items() if v}
            self._msgs.clear()
        return out

    def wait(self, timeout: float) -> bool:
        """Block until at least one message is waiting, at most `timeout` s; True if there is one."""
        with self._cond:
            return self._cond.wait_for(lambda: any(self._msgs.values()), timeout)
