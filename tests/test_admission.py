"""Admission: what a request books (prompt + output budget on decode, prompt tokens on prefill), who waits, in
which order, and the reasons of its refusals. Workers here are plain WorkerStates (no actors are called)."""

import asyncio

import pytest

from coordinator.admission.admission import Admission
from coordinator.admission.reservation import Ledger
from coordinator.admission.router import Router, WorkerState
from coordinator.backend.pools import Pools
from coordinator.backend.supervisor import Supervisor
from coordinator.config.serve_config import AdmissionConfig, RecoveryConfig, ServeConfig
from coordinator.contract import GenerateRequest, Overloaded, RequestTooLarge, Unavailable
from engine.core.sampling_params import SamplingParams
from engine.load import WorkerInfo


def _setup(mode="disaggregated", decode_blocks=(100,), prefills=1, fallback=True, **admission):
    config = ServeConfig(mode=mode, admission=AdmissionConfig(**{"timeout_s": 0.3, **admission}),
                         recovery=RecoveryConfig(fallback=fallback))
    pools = Pools(config)
    pools.decode = [WorkerState(WorkerInfo(f"decode-{i}", "decode" if mode == "disaggregated" else "collocated", n,
                                           16, 4096, 1000, None), handle=None) for i, n in enumerate(decode_blocks)]
    pools.prefill = [WorkerState(WorkerInfo(f"prefill-{i}", "prefill", 100, 16, 4096, 1000, None), handle=None)
                     for i in range(prefills if mode == "disaggregated" else 0)]
    ledger = Ledger()
    supervisor = Supervisor(pools, RecoveryConfig(), on_dead=lambda w, r: None, on_live=lambda w: None)
    admission = Admission(config, supervisor, Router(16), ledger)
    ledger._on_release = admission.notify
    return admission, ledger, pools


def _request(prompt_len: int, max_tokens: int, priority: int = 2) -> GenerateRequest:
    return GenerateRequest("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), priority)


def test_books_prompt_plus_output_budget_on_decode_and_prompt_tokens_on_prefill():
    admission, ledger, pools = _setup()
    assert admission.kv_blocks(_request(100, 50), num_prior=0) == 11        # ceil(150 / 16) + 1
    assert admission.kv_blocks(_request(100, 50), num_prior=10) == 11       # prior outputs count as context
    half, _, _ = _setup(reserve_output=0.5)
    assert half.kv_blocks(_request(100, 50), num_prior=0) == 9               # ceil((100 + 25) / 16) + 1

    async def run():
        r = ledger.open("a")
        placement = await admission.place(_request(100, 50), 0, r)
        assert placement.decode is pools.decode[0] and placement.prefill is pools.prefill[0]
        assert ledger.check_integrity() == {"decode-0#0": {"kv_blocks": 11, "prompt_tokens": 0},
                                            "prefill-0#0": {"kv_blocks": 0, "prompt_tokens": 100}}
        r.release()
        assert ledger.booked("decode-0#0", "kv_blocks") == 0
    asyncio.run(run())


def test_a_request_that_can_never_fit_is_refused_at_once():
    admission, ledger, _ = _setup(decode_blocks=(10, 20))

    async def run():
        with pytest.raises(RequestTooLarge, match="at most 20"):
            await admission.place(_request(300, 50), 0, ledger.open("big"))
    asyncio.run(run())
    assert ledger.check_integrity() == {}


def test_waits_for_room_then_takes_what_a_finished_request_gave_back():
    admission, ledger, pools = _setup(decode_blocks=(20,))

    async def run():
        first = ledger.open("first")
        await admission.place(_request(200, 50), 0, first)                # 17 of 20 blocks
        second = ledger.open("second")
        waiting = asyncio.create_task(admission.place(_request(200, 50), 0, second))
        await asyncio.sleep(0.05)
        assert not waiting.done() and len(admission.queue) == 1
        first.release()                                                   # the ledger tells the queue
        placement = await asyncio.wait_for(waiting, 1)
        assert placement.decode is pools.decode[0] and ledger.booked("decode-0#0", "kv_blocks") == 17
        second.release()
    asyncio.run(run())


def test_no_room_within_the_timeout_is_a_503_naming_the_missing_room():
    admission, ledger, _ = _setup(decode_blocks=(20,))

    async def run():
        await admission.place(_request(200, 50), 0, ledger.open("holder"))
        with pytest.raises(Overloaded, match="no decode worker has room") as e:
            await admission.place(_request(200, 50), 0, ledger.open("late"))
        assert e.value.retry_after_s >= 1
    asyncio.run(run())


@pytest.mark.parametrize("mode", ["disaggregated", "collocated"])
def test_a_pool_without_live_workers_is_named_in_the_503(mode):
    admission, ledger, pools = _setup(mode=mode)
    pools.decode[0].state = "restarting"
    for w in pools.prefill:  # (disaggregated: with a live prefill worker the request would run whole there)
        w.state = "dead"

    async def run():
        with pytest.raises(Overloaded, match="the decode pool has no live worker \\(decode-0 restarting: a "
                                             "replacement is being started\\)"):
            await admission.place(_request(10, 5), 0, ledger.open("x"))
    asyncio.run(run())


def test_a_pool_with_no_live_worker_sends_whole_requests_to_the_other_pool_until_its_replacement_is_live():
    admission, ledger, pools = _setup()
    pools.decode[0].state = "restarting"

    async def run():
        moved = await admission.place(_request(100, 50), 7, ledger.open("moved"), migrating=True)
        new = await admission.place(_request(20, 5), 0, ledger.open("new"))
        for placement in (moved, new):  # whole on the prefill worker (the collocated path), booked there
            assert placement.decode is pools.prefill[0] and placement.prefill is None
        blocks = admission.kv_blocks(_request(100, 50), 7) + admission.kv_blocks(_request(20, 5), 0)
        assert ledger.check_integrity() == {"prefill-0#0": {"kv_blocks": blocks, "prompt_tokens": 107 + 20}}
        pools.decode[0].state = "live"  # the replacement is live: the normal split again
        back = await admission.place(_request(20, 5), 0, ledger.open("back"))
        assert back.decode is pools.decode[0] and back.prefill is pools.prefill[0]
        pools.prefill[0].state = "restarting"  # and the other way round: a local prefill on the decode worker
        local = await admission.place(_request(20, 5), 0, ledger.open("local"))
        assert local.decode is pools.decode[0] and local.prefill is None
        assert ledger.booked("decode-0#0", "prompt_tokens") == 20
    asyncio.run(run())
    assert admission.fallbacks == {"decode": 2, "prefill": 1}


def test_a_fallback_worker_without_room_waits_like_any_other():
    admission, ledger, pools = _setup()
    pools.decode[0].state = "dead"

    async def run():
        await admission.place(_request(1500, 10), 0, ledger.open("big"))  # 96 of prefill-0's 100 blocks
        with pytest.raises(Overloaded, match="the decode pool has no live worker"):
            await admission.place(_request(100, 10), 0, ledger.open("late"))
    asyncio.run(run())
    assert admission.fallbacks == {"decode": 1, "prefill": 0}


def test_partial_loss_routes_around_the_dead_worker_at_once():
    admission, ledger, pools = _setup(decode_blocks=(100, 100))
    pools.decode[0].state = "dead"

    async def run():
        placement = await admission.place(_request(10, 5), 0, ledger.open("x"))
        assert placement.decode is pools.decode[1]
    asyncio.run(run())


def test_prefill_backlog_cap_in_tokens_but_an_idle_worker_takes_any_prompt():
    admission, ledger, pools = _setup(decode_blocks=(1000,), max_prefill_backlog_tokens=150)

    async def run():
        await admission.place(_request(400, 5), 0, ledger.open("huge"))   # above the cap, but prefill-0 is idle
        with pytest.raises(Overloaded, match="backlog is full"):
            await admission.place(_request(10, 5), 0, ledger.open("small"))
    asyncio.run(run())


def test_higher_priority_and_migrations_go_first_when_room_frees():
    admission, ledger, _ = _setup(decode_blocks=(20,))
    order = []

    async def wait(name, priority, migrating=False):
        r = ledger.open(name)
        await admission.place(_request(200, 50, priority), 0, r, migrating=migrating)
        order.append(name)
        r.release()

    async def run():
        holder = ledger.open("holder")
        await admission.place(_request(200, 50), 0, holder)
        low = asyncio.create_task(wait("low", 3))
        await asyncio.sleep(0.01)
        high = asyncio.create_task(wait("high", 1))
        await asyncio.sleep(0.01)
        moved = asyncio.create_task(wait("moved", 3, migrating=True))
        await asyncio.sleep(0.01)
        holder.release()
        await asyncio.gather(low, high, moved)
    asyncio.run(run())
    assert order == ["moved", "high", "low"]


def test_reserved_for_high_keeps_room_that_only_high_priority_requests_book():
    admission, ledger, _ = _setup(decode_blocks=(100,), reserved_for_high=0.3)

    async def run():
        for i in range(3):  # 3 x 21 blocks = 63 of the 70 that normal requests may book
            await admission.place(_request(300, 15), 0, ledger.open(f"normal-{i}"))
        with pytest.raises(Overloaded):
            await admission.place(_request(300, 15, priority=3), 0, ledger.open("low"))
        await admission.place(_request(300, 15, priority=1), 0, ledger.open("high"))  # into the reserved 30
        assert ledger.booked("decode-0#0", "kv_blocks") == 84
    asyncio.run(run())


def test_a_request_aged_into_the_high_class_books_as_high_and_does_not_block_the_queue():
    admission, ledger, _ = _setup(decode_blocks=(100,), reserved_for_high=0.3, priority_aging_s=0.05, timeout_s=30)

    async def run():
        for i in range(3):  # 63 of the 70 blocks that requests below high may book
            await admission.place(_request(300, 15), 0, ledger.open(f"normal-{i}"))
        low = asyncio.create_task(admission.place(_request(300, 15, priority=3), 0, ledger.open("low")))
        await asyncio.sleep(0.3)   # several aging periods: now the head of the queue, in the high class
        assert not low.done()
        admission.notify()         # the server's stats loop does this every second
        await asyncio.wait_for(low, 10)  # booked into the share kept for high, as a high request would be
        assert ledger.booked("decode-0#0", "kv_blocks") == 84
    asyncio.run(run())


@pytest.mark.parametrize("bypass_s, small_first", [(5.0, True), (0.0, False)])
def test_a_small_request_is_placed_ahead_of_a_large_one_waiting_for_room(bypass_s, small_first):
    """No head-of-line blocking (admission.bypass_s): a request that fits is placed while a larger one ahead of it
    waits for room; with bypass_s 0 it waits behind it."""
    admission, ledger, pools = _setup(decode_blocks=(100,), timeout_s=5, bypass_s=bypass_s)

    async def run():
        held = ledger.open("held")
        await admission.place(_request(900, 10), 0, held)                  # 58 of the 100 blocks
        big = asyncio.ensure_future(admission.place(_request(900, 10), 0, ledger.open("big")))  # 58: waits
        await asyncio.sleep(0.01)
        small = asyncio.ensure_future(admission.place(_request(100, 10), 0, ledger.open("small")))  # 8: fits now
        await asyncio.sleep(0.05)
        assert small.done() == small_first and not big.done()
        held.release()                                                     # room for big (and small after it)
        await asyncio.wait_for(asyncio.gather(big, small), 2)
    asyncio.run(run())


def test_a_pool_whose_slots_gave_up_refuses_at_once_new_and_waiting_requests():
    """Without fallback, a request needs both pools: once the only prefill slot gave up (state "failed", back only by
    an operator's revive) it is refused at once, naming the slot, where it waited out admission.timeout_s before."""
    admission, ledger, pools = _setup(fallback=False, timeout_s=600)

    async def run():
        pools.prefill[0].state = "restarting"                        # a replacement is coming: the request waits
        waiting = asyncio.create_task(admission.place(_request(10, 5), 0, ledger.open("waits")))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        pools.prefill[0].state = "failed"                             # its restarts gave up (the supervisor tells)
        admission.notify()
        with pytest.raises(Unavailable, match="the prefill pool has no live worker .prefill-0 failed") as refused:
            await asyncio.wait_for(waiting, 5)
        assert refused.value.retry_after_s > 0
        with pytest.raises(Unavailable, match="revives it"):
            await asyncio.wait_for(admission.place(_request(10, 5), 0, ledger.open("new")), 5)
    asyncio.run(run())
    assert ledger.check_integrity() == {} and len(admission.queue) == 0


def test_with_fallback_one_pool_that_gave_up_leaves_the_other_serving_and_both_refuse_at_once():
    admission, ledger, pools = _setup(fallback=True, timeout_s=600)

    async def run():
        pools.prefill[0].state = "failed"
        placed = await asyncio.wait_for(admission.place(_request(10, 5), 0, booked := ledger.open("a")), 5)
        assert placed.decode is pools.decode[0] and placed.prefill is None  # whole on the decode worker
        booked.release()
        pools.decode[0].state = "failed"
        with pytest.raises(Unavailable, match="prefill pool has no live worker.*decode pool has no live worker"):
            await asyncio.wait_for(admission.place(_request(10, 5), 0, ledger.open("b")), 5)
        pools.decode[0].state = "restarting"  # one pool can come back: with fallback the request waits for it
        waiting = asyncio.create_task(admission.place(_request(10, 5), 0, ledger.open("c")))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        pools.decode[0].state = "live"         # the replacement is up: the request runs on it (fallback)
        admission.notify()
        assert (await asyncio.wait_for(waiting, 5)).decode is pools.decode[0]
    asyncio.run(run())


def test_the_prefill_pick_says_what_the_prefill_worker_held_before_it_was_picked():
    """Placement.prefill_held_tokens (coordinator.backend.prefix_fetch's own run): routing remembers the prompt as
    the picked worker's at once, so this is read before the pick; a later turn of the same conversation finds it."""
    admission, _, pools = _setup()
    ledger = admission.ledger

    async def run():
        first = await admission.place(_request(40, 8), 0, ledger.open("a"))
        assert first.prefill is pools.prefill[0] and first.prefill_held_tokens == 0  # nothing held before
        again = await admission.place(_request(40, 8), 0, ledger.open("b"))
        assert again.prefill_held_tokens == 32  # the 2 whole blocks routed there the first time
        longer = await admission.place(_request(72, 8), 0, ledger.open("c"))
        assert longer.prefill_held_tokens == 32
    asyncio.run(run())


def test_the_adaptive_layout_decodes_a_conversation_where_its_history_is():
    """Mode adaptive: the decode worker is the one holding the prompt's leading blocks (it decoded the last turn:
    the router remembered prompt and reply), room allowing; a prompt nobody holds goes to the roomiest."""
    from coordinator.config.adaptive_config import SLOConfig

    config = ServeConfig(mode="adaptive", slo=SLOConfig(ttft_ms=500, tpot_ms=40),
                         admission=AdmissionConfig(timeout_s=0.3))
    pools = Pools(config)
    pools.decode = [WorkerState(WorkerInfo(f"w-{i}", "mixed", 100 + i, 16, 4096, 1000, None), handle=None,
                                role="mixed") for i in range(2)]
    pools.prefill = list(pools.decode)
    ledger = Ledger()
    supervisor = Supervisor(pools, RecoveryConfig(), on_dead=lambda w, r: None, on_live=lambda w: None)
    admission = Admission(config, supervisor, Router(16), ledger)
    history = list(range(1, 81))
    admission.router.remember(history, "w-0")  # w-0 decoded the last turn (AdaptiveLayout.decoded)

    async def run():
        turn = await admission.place(GenerateRequest("t", [*history, 5, 6, 7], SamplingParams(max_tokens=8), 2), 0,
                                     ledger.open("t"))
        assert turn.decode.name == "w-0"  # though w-1 has more room
        other = await admission.place(GenerateRequest("o", list(range(500, 540)), SamplingParams(max_tokens=8), 2),
                                      0, ledger.open("o"))
        assert other.decode.name == "w-1"  # the roomiest
    asyncio.run(run())
