"""decode_pool.reservations on a real engine loop (tiny model): an early booking is taken by the handoff or given
back by cancel, whatever moment the cancel lands at, and a full cache ends an untaken booking without a leak."""

from __future__ import annotations

import asyncio

import pytest

from decode_pool.reservations import NoCapacity, Reservations
from engine import LLM
from engine.async_engine import AsyncEngine

T40 = list(range(3, 43))  # 40 tokens of KV: 3 blocks of 16


def run_with_loop(body, **engine_kwargs):
    """body(reservations, engine) on a running AsyncEngine loop; then the engine's integrity check."""
    engine = LLM("tiny", **engine_kwargs).engine

    async def main():
        loop = AsyncEngine(engine, lambda outputs, load: None)
        task = asyncio.create_task(loop.run())
        try:
            return await body(Reservations(loop, "decode-test", timeout_s=0.3), engine)
        finally:
            loop.close()
            await task
    result = asyncio.run(main())
    assert engine.check_integrity()["in_use"] == 0
    return result


def test_an_early_booking_is_taken_by_the_handoff():
    async def body(res: Reservations, engine):
        res.book_early("a", T40)
        booking = await res.take("a", T40)
        assert len(booking.blocks) == 3 and engine.load().num_reserved == 1 and len(res) == 0
        assert booking.fence.event is None and booking.fence.follower_launches is None  # CPU, no followers
        await res.loop.call(lambda e: e.abort("a"))
    run_with_loop(body)


@pytest.mark.parametrize("wait_s", [None, 0.0, 0.05])  # before the loop applied it, just after, long after
def test_a_cancelled_early_booking_gives_its_blocks_back(wait_s):
    async def body(res: Reservations, engine):
        res.book_early("b", T40)
        if wait_s is not None:
            await asyncio.sleep(wait_s)
        if wait_s == 0.05:  # the booking was made: the cancel must free it
            assert engine.load().num_reserved == 1
        assert await res.cancel("b")
        assert not await res.cancel("b")  # once
        assert engine.load().num_reserved == 0 and len(res) == 0
    run_with_loop(body)


def test_a_booking_that_finds_no_room_ends_in_no_capacity_and_leaks_nothing():
    async def body(res: Reservations, engine):
        whole = engine.num_kv_blocks * engine.config.block_size
        res.book_early("big", [3] * (whole + 1))
        with pytest.raises(NoCapacity, match="decode-test: no room for"):
            await res.take("big", [3] * (whole + 1))
        res.book_early("big2", [3] * (whole + 1))
        assert await res.cancel("big2")  # ended while it was still retrying
    run_with_loop(body, num_kv_blocks=8)


def test_a_handoff_arriving_after_its_abort_books_nothing():
    """The abort overtook the handoff (the client left as the prefill ended): the late take is refused, and a late
    early booking is not made, so no request runs to max_tokens with nobody reading it."""
    from decode_pool.reservations import RequestEnded

    async def body(res: Reservations, engine):
        assert not await res.cancel("late")  # nothing booked yet: the abort still remembers the id
        res.book_early("late", T40)
        with pytest.raises(RequestEnded, match="late was aborted before its handoff"):
            await res.take("late", T40)
        assert engine.load().num_reserved == 0 and len(res) == 0
        booking = await res.take("other", T40)  # other requests are untouched
        assert len(booking.blocks) == 3
        await res.loop.call(lambda e: e.abort("other"))
    run_with_loop(body)


@pytest.mark.parametrize("wait_s", [None, 0.05])  # the booking still queued on the loop, or made
def test_an_engine_call_arriving_after_a_cancel_finds_the_blocks_given_back(wait_s):
    """The abort is queued on the loop before the cancel first waits: a call that reaches the worker after it (the
    admin integrity check after the coordinator's aborts) never sees the cancelled booking."""
    async def body(res: Reservations, engine):
        res.book_early("c", T40)
        if wait_s is not None:
            await asyncio.sleep(wait_s)
        cancel = asyncio.create_task(res.cancel("c"))
        await asyncio.sleep(0)  # the cancel runs up to its first wait
        assert (await res.loop.call(lambda e: e.load())).num_reserved == 0
        assert await cancel
    run_with_loop(body)


@pytest.mark.parametrize("stagger_steps", [0, 2])  # the streams admitted together, or steps apart (a loaded machine)
def test_a_booking_waits_while_running_streams_need_the_free_blocks_and_preempts_none(stagger_steps):
    """3 streams of 17 prompt tokens (2 blocks each) decode to 41 tokens (3 blocks each) on 10 blocks: 4 are free
    for their first 15 steps, enough for a 40-token booking (3 blocks) but then not for the streams' third blocks,
    which would preempt one of them. The booking waits until streams end and leave it room beside the others' next
    blocks instead: made, and nothing preempted while the streams still running go on to their end beside it.
    (The 15 steps before they cross into a third block leave the check room on a loaded machine; with 31-token
    prompts there was one step, and the CI machine once missed it. A loaded machine may also admit the streams
    steps apart, as `stagger_steps` does, so that some still run when the booking is made: the loop is closed only
    once they have ended. The stagger is counted in engine steps, taken before the loop starts: a stagger in seconds
    let the first stream end before the third was admitted on a fast step, and the wait for three running never
    ended.)"""
    from engine import SamplingParams
    from tests.engine_helpers import random_prompts

    engine = LLM("tiny", num_kv_blocks=10, enable_prefix_caching=False).engine
    prompts = random_prompts((17, 17, 17), 2000, seed=3802)

    async def main():
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
            for _ in range(stagger_steps if i < len(prompts) - 1 else 0):
                engine.step()
        loop = AsyncEngine(engine, lambda outputs, load: None)
        task = asyncio.create_task(loop.run())
        try:
            while not await loop.call(lambda e: len(e.scheduler.running) == 3
                                      and all(r.num_output_tokens for r in e.scheduler.running)):
                await asyncio.sleep(0.001)
            refused = await loop.call(lambda e: (e.block_manager.num_free_blocks, e.reserve_blocks("x", 40, True)))
            res = Reservations(loop, "decode-test", timeout_s=60)
            booking = await res.take("x", T40)
            while await loop.call(lambda e: e.has_unfinished()):  # the streams end beside the booking
                await asyncio.sleep(0.005)
            await loop.call(lambda e: e.abort("x"))
            return refused, booking
        finally:
            loop.close()
            await task
    (free, refused), booking = asyncio.run(main())
    assert free >= 3 and refused is None  # it fit the free blocks, not beside the streams' next blocks
    assert len(booking.blocks) == 3
    assert engine.load().preemptions_total == 0
    assert engine.check_integrity()["in_use"] == 0


def test_a_booking_shares_the_blocks_the_prefix_cache_holds_and_gives_them_back():
    """A conversation's first turn ran here (prompt + answer now in the prefix cache); the next turn's booking
    starts its table with those blocks (shared, ref counted: `skip` of them), books new blocks only for the rest,
    and the partial last block is always new. Cancelled, the shared blocks go back to the cache, nothing leaks; taken
    and joined, the engine counts them (EngineLoad.handoff_hit_blocks_total)."""
    from engine import SamplingParams
    from engine.core.request import RequestStatus
    from tests.engine_helpers import random_prompts

    llm = LLM("tiny")
    engine = llm.engine
    first = random_prompts((40,), 2000, seed=3401)[0]
    answer = llm.generate([first], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].token_ids
    turn2 = [*first, *answer, *range(100, 127)]  # 97 tokens: 7 blocks; 69 tokens of KV computed: 4 full blocks
    cached = engine.block_manager.cached_prefix(turn2)
    assert len(cached) == 4

    async def main():
        loop = AsyncEngine(engine, lambda outputs, load: None)
        task = asyncio.create_task(loop.run())
        res = Reservations(loop, "decode-test", timeout_s=5)
        try:
            res.book_early("t2", turn2)
            booking = await res.settled("t2", turn2)
            state = await loop.call(lambda e: (e.check_integrity(), e.block_manager.num_cached_blocks))
            assert await res.cancel("t2")
            after_cancel = await loop.call(lambda e: (e.check_integrity(), e.block_manager.num_cached_blocks))
            with pytest.raises(ValueError, match="handed over with 97 other ones"):
                res.book_early("t3", turn2[:-1] + [5])
                await res.take("t3", turn2)
            await loop.call(lambda e: e.abort("t3"))
            taken = await res.take("t4", turn2)
            done = await loop.call(lambda e: (e.add_prefilled_request("t4", turn2, 7, SamplingParams(max_tokens=2)),
                                              e.scheduler.requests["t4"].status, e.load()))
            return booking, state, after_cancel, taken, done
        finally:
            loop.close()
            await task
    booking, (integrity, cached_then), (integrity_after, cached_after), taken, done = asyncio.run(main())
    assert booking.skip == 4 and booking.blocks[:4] == cached and len(booking.blocks) == 7
    assert not set(booking.blocks[4:]) & set(cached)
    assert integrity["in_use"] == 0 and integrity["pinned"] == 7  # the reservation's 4 shared + 3 new
    assert cached_after == cached_then + 4 and integrity_after["pinned"] == 0
    assert taken.skip == 4 and taken.blocks[:4] == cached
    assert done[0] is None and done[1] == RequestStatus.RUNNING and done[2].handoff_hit_blocks_total == 4
    engine.abort("t4")
    assert engine.check_integrity()["in_use"] == 0
    assert engine.block_manager.cached_prefix(turn2)[:4] == cached  # (t4's own full blocks were cached after it)


def test_an_early_booking_arriving_after_its_handoff_books_nothing():
    """Ray ran the handoff's call before the early booking's (it orders no async actor's calls): the handoff booked
    its own blocks, and the late early booking must not book another set, which nothing would ever take or free
    (no abort follows a request that finished)."""
    from decode_pool.reservations import RequestEnded

    async def body(res: Reservations, engine):
        booking = await res.take("d", T40)  # nothing booked early: booked now
        res.book_early("d", T40)
        with pytest.raises(RequestEnded, match="d was handed over before its blocks were booked"):
            await res.settled("d", T40)  # a late reserve_for_push
        assert engine.load().num_reserved == 1 and len(res) == 0 and len(booking.blocks) == 3
        await res.loop.call(lambda e: e.abort("d"))
    run_with_loop(body)
