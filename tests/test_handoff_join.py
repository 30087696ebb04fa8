"""Handoffs.take_over's early join (decode_pool.handoff) on the real tiny engine and its AsyncEngine loop: at TP=1
over cuda_ipc a request joins as soon as its pull is queued, take_over returns once the copies have ended, an abort
while they run is applied after them, and copies that never end take the process down (its GPU's stream would
wait for them forever). CUDA copies do not exist on this machine: the pull is a stand-in (a GroupRead whose events
complete when the test says), and LLMEngine.order_after has no device queue to order on the CPU."""

import asyncio
import concurrent.futures
import threading
import time

import pytest

from decode_pool import handoff as handoff_module
from decode_pool.handoff import Handoffs
from decode_pool.reservations import Reservations
from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.core.request_timing import RequestTiming
from kvtransfer.errors import TransferTimeout
from kvtransfer.worker_agents import GroupRead

PROMPT = list(range(3, 3 + 64))  # 4 full blocks of 16
PARAMS = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)  # still running when the test looks


class CopyEvent:
    def __init__(self) -> None:
        self.ended = threading.Event()

    def query(self) -> bool:
        return self.ended.is_set()

    def synchronize(self) -> None:
        self.ended.wait()


class QueuedPull:
    """WorkerAgents' stand-in: every read returns the same GroupRead (copies queued, ending when the test says)."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.event, self.future = CopyEvent(), concurrent.futures.Future()
        self.timeout_s = timeout_s

    def read(self, peer, remote_ids, local_ids, ready=None, after_launches=None) -> GroupRead:
        return GroupRead(self.future, (self.event,), time.monotonic() + self.timeout_s)


def run(body, pull: QueuedPull):
    engine = LLM("tiny").engine

    async def main():
        loop = AsyncEngine(engine, lambda outputs, load: None)
        task = asyncio.create_task(loop.run())
        handoffs = Handoffs("decode-t", loop, pull, Reservations(loop, "decode-t", 1.0), RequestTiming())
        try:
            return await body(loop, handoffs)
        finally:
            loop.close()
            await task
    return asyncio.run(main()), engine


def test_joins_before_its_copies_end_and_returns_once_they_have():
    pull = QueuedPull()

    async def body(loop, handoffs):
        task = asyncio.create_task(handoffs.take_over("r", PROMPT, PARAMS, 5, None, "prefill-0", list(range(8)), []))
        await asyncio.sleep(0.2)
        joined = await loop.call(lambda e: "r" in e.scheduler.requests)
        returned_early = task.done()
        pull.event.ended.set()
        await asyncio.wait_for(task, 10)
        return joined, returned_early
    (joined, returned_early), _ = run(body, pull)
    assert joined and not returned_early  # in the batch while its KV lands; the peer's copy is freed only after


def test_an_abort_while_its_copies_run_is_applied_after_them():
    pull = QueuedPull()

    async def body(loop, handoffs):
        task = asyncio.create_task(handoffs.take_over("r", PROMPT, PARAMS, 5, None, "prefill-0", list(range(8)), []))
        await asyncio.sleep(0.2)
        assert handoffs.abort("r")  # flagged: take_over frees the blocks once the copies have ended
        await asyncio.sleep(0.1)
        assert not task.done()
        pull.event.ended.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
        return await loop.call(lambda e: e.check_integrity())
    integrity, engine = run(body, pull)
    assert integrity["in_use"] == 0 and "r" not in engine.scheduler.requests


def test_copies_that_never_end_take_the_process_down(monkeypatch):
    pull = QueuedPull(timeout_s=0.05)
    exits: list[str] = []

    def exit_process(worker: str, why: str) -> None:  # the real one ends the process (os._exit)
        exits.append(why)
        raise SystemExit(70)
    monkeypatch.setattr(handoff_module, "exit_process", exit_process)

    async def body(loop, handoffs):
        # the timers start once the engine is built (a slow start on a loaded machine used to outlast them)
        threading.Timer(0.2, pull.future.set_exception, (TransferTimeout("GPU copy did not finish"),)).start()
        threading.Timer(1.0, pull.event.ended.set).start()  # at last: the loop's executor thread waiting on it may go
        with pytest.raises(SystemExit):
            await handoffs.take_over("r", PROMPT, PARAMS, 5, None, "prefill-0", list(range(8)), [])
    run(body, pull)
    assert exits and "did not end" in exits[0]


# Pushed handoffs (prefill_pool.kv_push): the KV is in the booked blocks already; the prefill worker's notification
# starts the join, and the coordinator's decode() call (which may come before or after it) takes its outcome.

def test_a_join_started_by_the_notification_is_the_one_decode_returns():
    async def body(loop, handoffs):
        handoffs.expect_push("r", PROMPT, PARAMS, [])
        handoffs.pushed("r", 5, None, time.monotonic())
        for _ in range(200):  # the join runs on its own, before any decode() call
            if await loop.call(lambda e: "r" in e.scheduler.requests):
                break
            await asyncio.sleep(0.01)
        joined_alone = await loop.call(lambda e: "r" in e.scheduler.requests)
        done = await handoffs.take_over("r", PROMPT, PARAMS, 5, None, "", [], [], pushed=True)
        handoffs.pushed("r", 5, None, time.monotonic())  # a late duplicate starts nothing
        await asyncio.sleep(0.05)
        return joined_alone, done, await loop.call(lambda e: [r for r in e.scheduler.requests if r == "r"])
    (joined_alone, done, ids), _ = run(body, QueuedPull())
    assert joined_alone and done is None and ids == ["r"]


def test_a_notification_after_decode_started_the_join_starts_nothing():
    async def body(loop, handoffs):
        handoffs.expect_push("r", PROMPT, PARAMS, [])
        done = await handoffs.take_over("r", PROMPT, PARAMS, 5, None, "", [], [], pushed=True)
        handoffs.pushed("r", 5, None, time.monotonic())
        await asyncio.sleep(0.05)
        return done, await loop.call(lambda e: e.abort("r")), await loop.call(lambda e: e.check_integrity())
    (done, aborted, integrity), _ = run(body, QueuedPull())
    assert done is None and aborted and integrity["in_use"] == 0


def test_an_abort_right_after_the_notification_frees_the_blocks_and_decode_gets_the_cancellation():
    async def body(loop, handoffs):
        handoffs.expect_push("r", PROMPT, PARAMS, [])
        handoffs.reservations.book_early("r", PROMPT)
        handoffs.pushed("r", 5, None, time.monotonic())
        await handoffs.reservations.cancel("r")  # DecodeWorker.abort: the booking, then the flag
        handoffs.abort("r")
        handoffs.forget("r")
        await asyncio.sleep(0.1)
        with pytest.raises((asyncio.CancelledError, RuntimeError)):
            await handoffs.take_over("r", PROMPT, PARAMS, 5, None, "", [], [], pushed=True)
        return await loop.call(lambda e: ("r" in e.scheduler.requests, e.check_integrity()))
    (present, integrity), _ = run(body, QueuedPull())
    assert not present and integrity["in_use"] == 0
