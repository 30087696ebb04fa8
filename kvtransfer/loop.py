"""`LoopThread`: the agent's own asyncio event loop on a dedicated daemon thread.

All UCX work of an agent happens here, so the caller (an engine's step loop) never blocks on the network:
`submit()` schedules a coroutine and returns a concurrent Future at once; `call()` waits for it with a
timeout. `stop()` cancels what is left and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from .errors import TransferTimeout

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"kvtransfer-{name}", daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait(10.0)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop and wait for its result, at most `timeout` s (then TransferTimeout)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError as e:
            fut.cancel()
            raise TransferTimeout(f"agent operation did not finish within {timeout} s") from e

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self, timeout: float = 5.0) -> None:
        if not self._thread.is_alive():
            return

        async def _cancel_rest() -> None:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            if rest:
                await asyncio.wait(rest, timeout=timeout)

        try:
            self.submit(_cancel_rest()).result(timeout + 1.0)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
