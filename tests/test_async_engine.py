"""engine.async_engine on a real engine (tiny): the engine thread steps and runs queued calls between steps, in the
order queued, off the event loop's thread; a call cancelled before its turn is skipped; outputs reach the loop with
the load taken after their step; a request with no room waits for a call instead of spinning the thread; a failing
step fails run() and every call still queued, with its error."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine():
    return LLM("tiny").engine


def test_calls_run_in_order_on_the_engine_thread_and_outputs_reach_the_loop_with_their_load(engine):
    async def main():
        seen: list = []
        loop_thread = threading.get_ident()

        def on_outputs(outputs, load):
            seen.append((threading.get_ident(), [o.request_id for o in outputs], load.num_running + load.num_waiting))
        runner = AsyncEngine(engine, on_outputs)
        task = asyncio.create_task(runner.run())
        order: list[int] = []
        threads = await asyncio.gather(*[runner.call(lambda e, i=i: (order.append(i), threading.get_ident())[1])
                                         for i in range(5)])
        await runner.call(lambda e: e.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
        while not any("r" in ids for _, ids, _ in seen) or await runner.call(lambda e: e.has_unfinished()):
            await asyncio.sleep(0.01)
        runner.close()
        await task
        return loop_thread, order, set(threads), seen
    loop_thread, order, threads, seen = asyncio.run(main())
    assert order == [0, 1, 2, 3, 4]
    assert len(threads) == 1 and loop_thread not in threads  # one engine thread, not the loop's
    assert seen and all(thread == loop_thread for thread, _, _ in seen)  # outputs handed to the loop
    assert sum(len(ids) for _, ids, _ in seen) == 4 and seen[-1][2] == 0  # 4 steps' outputs; the last left none


def test_a_call_cancelled_before_its_turn_is_skipped(engine):
    async def main():
        runner = AsyncEngine(engine, lambda outputs, load: None)
        task = asyncio.create_task(runner.run())
        gate, entered, ran = threading.Event(), threading.Event(), []
        first = runner.submit(lambda e: (entered.set(), gate.wait(10)))  # holds the engine thread
        await asyncio.to_thread(entered.wait, 10)
        skipped = runner.submit(lambda e: ran.append("skipped"))
        after = runner.submit(lambda e: ran.append("after"))
        skipped.cancel()
        gate.set()
        await first
        await after
        runner.close()
        await task
        return ran
    assert asyncio.run(main()) == ["after"]


def test_a_request_without_room_waits_for_a_call_instead_of_spinning_the_thread():
    small = LLM("tiny", num_kv_blocks=8).engine

    async def main() -> tuple[int, bool]:
        runner = AsyncEngine(small, lambda outputs, load: None)
        task = asyncio.create_task(runner.run())
        held = await runner.call(lambda e: e.reserve_blocks("held", e.block_manager.num_free_blocks * 16))
        assert held is not None  # every block booked (as for a KV transfer)
        await runner.call(lambda e: e.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)))
        steps = runner.steps
        await asyncio.sleep(0.3)
        stuck_steps = runner.steps - steps
        await runner.call(lambda e: e.abort("held"))  # room again: the request runs at once, woken by the call
        while await runner.call(lambda e: e.has_unfinished()):
            await asyncio.sleep(0.01)
        done = "r" not in small.scheduler.requests
        runner.close()
        await task
        return stuck_steps, done
    stuck_steps, done = asyncio.run(main())
    assert done
    assert stuck_steps < 50, stuck_steps  # a retry at once would step thousands of times in that while


def test_a_failing_step_fails_run_and_the_calls_still_queued(engine, monkeypatch):
    async def main():
        runner = AsyncEngine(engine, lambda outputs, load: None)
        inside, release = threading.Event(), threading.Event()

        def failing_step(layer_hook=None):
            inside.set()
            release.wait(10)
            raise RuntimeError("boom")
        monkeypatch.setattr(engine, "step", failing_step)
        monkeypatch.setattr(engine, "has_unfinished", lambda: True)
        task = asyncio.create_task(runner.run())
        await asyncio.to_thread(inside.wait, 10)
        queued = runner.submit(lambda e: "never")  # behind the step that fails
        release.set()
        with pytest.raises(RuntimeError, match="boom"):
            await task
        with pytest.raises(RuntimeError, match="boom"):
            await queued
        with pytest.raises(RuntimeError, match="stopped"):
            runner.submit(lambda e: None)
    asyncio.run(main())
