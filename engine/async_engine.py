"""AsyncEngine: the one loop that owns an LLMEngine inside an asyncio program (a Ray actor, a test server).

Rule: only the loop touches the engine. Callers `call(fn)` to run `fn(engine)` between two steps and await its
result; steps run in a worker thread (so the event loop keeps serving RPCs while the model computes). Every
step's outputs go to `on_outputs`, on the event loop. A failing step fails the loop: `run()` raises and every
pending call gets the error, so owners notice instead of hanging.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from engine.core.scheduler import StepOutput

if TYPE_CHECKING:  # the type only: a process that merely hosts the worker class (the coordinator) needs no torch
    from engine.llm_engine import LLMEngine

T = TypeVar("T")

IDLE_WAKEUP_S = 0.05  # an idle loop still wakes up to expire pinned blocks' leases


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[StepOutput]], None]) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._calls: list[tuple[Callable[[LLMEngine], Any], asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._closed = False
        self.steps = 0

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the loop between steps; returns its result or raises its exception."""
        return await self.submit(fn)

    def submit(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future:
        """Queue fn(engine) now, before anything the caller awaits next; the future of its result. Calls run in
        the order they were queued; a cancelled future's call is skipped."""
        if self._closed:
            raise RuntimeError("the engine loop has stopped")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls.append((fn, future))
        self._wakeup.set()
        return future

    async def run(self) -> None:
        try:
            while not self._closed:
                self._apply_calls()
                if self.engine.has_unfinished() or self._has_pins():
                    outputs = await asyncio.to_thread(self.engine.step)
                    self.steps += 1
                    if outputs:
                        self._on_outputs(outputs)
                    if not self.engine.has_unfinished():
                        await self._idle()
                else:
                    await self._idle()
        except BaseException as e:
            self._fail_pending(e)
            raise
        finally:
            self._closed = True
            self._fail_pending(RuntimeError("the engine loop has stopped"))

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()

    def kill_rank(self, rank: int) -> int:
        """Drills: SIGKILL tensor-parallel rank `rank` (1..N-1) of the engine; its pid (the engine then fails at its
        next step, and its worker is replaced). ValueError for a rank the engine does not have."""
        followers = self.engine.followers
        if followers is None:
            raise ValueError(f"no tensor-parallel rank {rank}: this worker runs tensor_parallel_size 1")
        return followers.kill(rank)

    # ---- internals
    async def _idle(self) -> None:
        try:
            await asyncio.wait_for(self._wakeup.wait(), IDLE_WAKEUP_S)
        except TimeoutError:
            pass
        self._wakeup.clear()

    def _has_pins(self) -> bool:
        return bool(self.engine.scheduler.expired_pins())

    def _apply_calls(self) -> None:
        calls, self._calls = self._calls, []
        for fn, future in calls:
            if future.done():
                continue
            try:
                future.set_result(fn(self.engine))
            except Exception as e:  # the caller gets its own error; the loop goes on
                future.set_exception(e)

    def _fail_pending(self, error: BaseException) -> None:
        calls, self._calls = self._calls, []
        for _, future in calls:
            if not future.done():
                future.set_exception(error if isinstance(error, Exception) else RuntimeError(str(error)))


def exit_process_on_failure(task: asyncio.Task, name: str) -> None:
    """For a process that exists to host one engine loop (a pool worker): when the loop fails, the process exits,
    so its supervisor sees a dead worker and replaces it. A failed loop never recovers (e.g. a lost tensor-parallel
    rank), and a live-looking worker that fails every call would never be replaced. Cancellation is not failure."""
    def done(t: asyncio.Task) -> None:
        if not t.cancelled() and t.exception() is not None:
            exit_process(name, f"the engine loop failed: {t.exception()!r}")
    task.add_done_callback(done)


def exit_process(name: str, why: str) -> None:
    """End a pool worker's process at once (its supervisor replaces it; its requests move elsewhere)."""
    print(f"{name}: {why}; exiting so the pool replaces this worker", file=sys.stderr, flush=True)
    os._exit(70)  # not sys.exit: Ray actors catch SystemExit

