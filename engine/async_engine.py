"""AsyncEngine: the one thread that owns an LLMEngine inside an asyncio program (a Ray actor, a test server).

Rule: only the engine thread touches the engine. It steps the engine back to back and, between two steps, runs
the calls queued by `call(fn)` / `submit(fn)` (in the order queued), whose results come back to the event loop as
futures, and those that `post(fn)` queues from any thread (no result: fn reports its own errors). Every step's
outputs go to `on_outputs(outputs, load)` on the event loop, with the engine's load taken right after that step (and
first, where given, to `step_hook(outputs, load)` on the engine thread: work that must not wait for the event loop;
it may keep some outputs from the loop, which is then not woken for a step with none left). Between steps, and
first whenever it would idle, the thread also captures the CUDA graphs left for after start
(LLMEngine.capture_deferred_graph). The event loop is never
on the stepping path: a step does not wait for it to run a callback, so serving RPCs and shipping outputs overlap
the next step instead of delaying it. A failing step fails the thread: `run()` raises and every pending call gets
the error, so owners notice instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from engine.core.scheduler import StepOutput

if TYPE_CHECKING:  # the types only: a process that merely hosts the worker class (the coordinator) needs no torch
    from engine.llm_engine import LayerHook, LLMEngine
    from engine.load import EngineLoad

T = TypeVar("T")
log = logging.getLogger(__name__)

IDLE_WAKEUP_S = 0.05  # an idle engine still wakes up to expire pinned blocks' leases


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_outputs: Callable[[list[StepOutput], EngineLoad], None],
                 layer_hook: LayerHook | None = None,
                 step_hook: Callable[[list[StepOutput], EngineLoad], list[StepOutput] | None] | None = None,
                 layer_hook_wanted: Callable[[], bool] | None = None) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._layer_hook = layer_hook  # passed to every step (LLMEngine.step), run on the engine thread
        # whether the next step needs the layer hook (None: every step); a step without one may overlap the next
        # (async scheduling), so a worker that only sometimes pushes KV keeps overlapping its other steps
        self._layer_hook_wanted = layer_hook_wanted
        # step_hook(outputs, load) on the engine thread first; it returns the outputs left for on_outputs (None: all)
        self._step_hook = step_hook
        self._calls: deque[tuple[Callable[[LLMEngine], Any], asyncio.Future | None]] = deque()
        self._wakeup = threading.Event()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.steps = 0
        self.outputs_at = 0.0  # inside on_outputs: time.monotonic() when the engine thread ended their step

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps; returns its result or raises its exception."""
        return await self.submit(fn)

    def submit(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future:
        """Queue fn(engine) now, before anything the caller awaits next; the future of its result. Calls run in
        the order they were queued; a call whose future is cancelled before its turn is skipped."""
        if self._closed:
            raise RuntimeError("the engine loop has stopped")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._calls.append((fn, future))
        self._wakeup.set()
        return future

    def post(self, fn: Callable[[LLMEngine], None]) -> None:
        """Queue fn(engine) from any thread, without a result (fn handles its own errors: one that escapes is
        logged). Queued in one order with submit()'s calls; RuntimeError once the loop has stopped."""
        if self._closed:
            raise RuntimeError("the engine loop has stopped")
        self._calls.append((fn, None))
        self._wakeup.set()

    async def run(self) -> None:
        """Step on the engine thread until close() or a failure (raised here)."""
        self._loop = asyncio.get_running_loop()
        ended: asyncio.Future = self._loop.create_future()
        threading.Thread(target=self._thread, args=(ended,), name="engine-step", daemon=True).start()
        try:
            await ended
        except Exception as e:
            self._fail_pending(e)  # the calls queued behind the failed step get its error
            raise
        finally:
            self.close()
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

    # ---- the engine thread
    def _thread(self, ended: asyncio.Future) -> None:
        error: BaseException | None = None
        try:
            while not self._closed:
                self._apply_calls()
                if self.engine.has_unfinished() or self._has_pins():
                    before = self._progress()
                    hook = self._layer_hook
                    if hook is not None and self._layer_hook_wanted is not None and not self._layer_hook_wanted():
                        hook = None
                    outputs = self.engine.step(hook)
                    self.steps += 1
                    if outputs:
                        load = self.engine.load()
                        if self._step_hook is not None:  # it may take some outputs off the event loop's way
                            left = self._step_hook(outputs, load)
                            outputs = outputs if left is None else left
                        if outputs:
                            self._post(self._deliver, outputs, load, time.monotonic())
                    self.engine.capture_deferred_graph(busy=True)  # now and then: a graph left for after start
                    if self.engine.has_unfinished() and (outputs or self._progress() != before):
                        continue
                if self.engine.capture_deferred_graph(busy=False):  # idle: the graphs left for after start first
                    continue
                self._idle()  # nothing to do, or nothing that can run until a call (or a lease's end) frees room
        except BaseException as e:  # handed to run(), which raises it on the event loop
            error = e
        self._closed = True
        self._post(_end, ended, error)

    def _deliver(self, outputs: list[StepOutput], load: EngineLoad, at: float) -> None:
        self.outputs_at = at
        self._on_outputs(outputs, load)

    def _idle(self) -> None:
        self._wakeup.wait(IDLE_WAKEUP_S)
        self._wakeup.clear()  # before the calls are read: a call queued from here on sets it again

    def _progress(self) -> tuple[int, int]:
        """What a step that did anything moved: tokens scheduled, requests preempted. A step that moved neither
        (its waiting requests have no room: KV booked for transfers, pinned for pulls) is not retried at once,
        which would spin this thread and hold the GIL the event loop needs to take the calls that free the room."""
        s = self.engine.scheduler
        return s.num_scheduled_tokens, s.num_preemptions

    def _has_pins(self) -> bool:
        return bool(self.engine.scheduler.expired_pins())

    def _apply_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            if future is None:  # post()'s
                try:
                    fn(self.engine)
                except Exception:
                    log.exception("a posted engine call failed")
                continue
            if future.done():  # cancelled by its caller
                continue
            try:
                self._post(_resolve, future, fn(self.engine), None)
            except Exception as e:  # the caller gets its own error; the thread goes on
                self._post(_resolve, future, None, e)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop has closed: nobody is left to tell
            self._closed = True

    def _fail_pending(self, error: BaseException) -> None:
        while self._calls:
            _, future = self._calls.popleft()
            if future is not None and not future.done():
                future.set_exception(error)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # its caller gave up meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _end(ended: asyncio.Future, error: BaseException | None) -> None:
    if ended.done():
        return
    if error is None:
        ended.set_result(None)
    else:
        ended.set_exception(error if isinstance(error, Exception) else RuntimeError(repr(error)))


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
