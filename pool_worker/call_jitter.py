"""CallJitter: the wait a worker injects before each request call it gets (faults.call_jitter_s), so that calls the
coordinator sent in one order may run in another. Ray runs an async actor's calls in no guaranteed order anyway (a
local Ray ran the second of two calls first in up to 5.75% of pairs, the more calls queued the more often:
benchmarks/ray_call_order.py); the drill makes that common, so every ordering the request path relies on is
tested."""

from __future__ import annotations

import asyncio
import random


class CallJitter:
    def __init__(self, max_s: float = 0.0, seed: int = 0) -> None:
        self.max_s = max_s
        self._rng = random.Random(seed)

    async def wait(self) -> None:
        """Sleep a random time in [0, max_s] (nothing when off)."""
        if self.max_s > 0:
            await asyncio.sleep(self._rng.uniform(0.0, self.max_s))
