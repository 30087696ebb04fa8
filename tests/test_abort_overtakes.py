"""An abort that overtakes the call it ends: Ray runs an async actor's calls in no guaranteed order (a local Ray ran the
second of two calls first in up to 5.75% of pairs: benchmarks/ray_call_order.py), so a worker may get its abort
before its prefill or generate. In this process, on the real tiny engine (pool_worker.worker.Worker, no Ray): the
late call is refused with RequestEnded and leaves nothing pinned or running, where before it was prefilled and pinned
until transfer.pin_lease_s (or generated to max_tokens for nobody); a call that no abort overtook runs as before."""

import asyncio

import pytest

from decode_pool.reservations import RequestEnded
from engine import SamplingParams
from engine.engine_config import EngineConfig
from pool_worker.worker import Worker

PROMPT = list(range(3, 3 + 40))
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def drive(role: str, body):
    async def main():
        worker = Worker(f"{role}-t", EngineConfig(model="tiny", max_num_seqs=4), None, 1, 5.0, role=role)
        await worker.start()
        try:
            return await asyncio.wait_for(body(worker), 60)
        finally:
            await worker.shutdown()
    return asyncio.run(main())


async def _held(worker: Worker) -> dict:
    return await worker.loop.call(lambda e: {"unfinished": e.has_unfinished(), **e.check_integrity()})


def test_a_prefill_its_abort_overtook_is_refused_and_pins_nothing():
    async def body(worker):
        assert await worker.abort("late") is False  # nothing here yet: the id is remembered
        with pytest.raises(RequestEnded, match="late was aborted before its prefill arrived"):
            await worker.prefill("late", PROMPT, PARAMS)
        after_refusal = await _held(worker)
        result = await worker.prefill("on-time", PROMPT, PARAMS)  # no abort ahead of it: pinned for decode
        pinned = await _held(worker)
        assert await worker.release("on-time")
        return after_refusal, result, pinned, await _held(worker)
    after_refusal, result, pinned, released = drive("prefill", body)
    assert after_refusal["pinned"] == 0 and after_refusal["in_use"] == 0, after_refusal
    assert result.block_ids and pinned["pinned"] == len(result.block_ids), pinned  # blocks
    assert released["pinned"] == 0 and released["in_use"] == 0, released


def test_a_generate_its_abort_overtook_is_refused_and_runs_nothing():
    async def body(worker):
        await worker.abort("late")
        with pytest.raises(RequestEnded, match="late was aborted before it arrived"):
            await worker.generate("late", PROMPT, PARAMS)
        return await _held(worker)
    held = drive("decode", body)
    assert not held["unfinished"] and held["in_use"] == 0, held


def test_a_group_its_abort_overtook_is_not_prefilled_and_an_aborted_choice_is_not_started():
    """A group prefilled on its decode worker (n > 1, no prefill worker): its abort overtaking prefill_group leaves
    nothing pinned; a choice aborted before decode_group arrived is not started, the others are."""
    params = [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, seed=i) for i in range(2)]

    async def body(worker):
        await worker.abort("late-group")
        with pytest.raises(RequestEnded, match="late-group was aborted before its prefill arrived"):
            await worker.prefill_group("late-group", PROMPT, params)
        refused = await _held(worker)
        out = await worker.prefill_group("g", PROMPT, params)
        firsts = [(out.new_token_ids[0], None), *(out.fork_first or [])]
        await worker.abort("g-1")  # this choice's client left before its group started here
        await worker.decode_group("g", ["g-0", "g-1"], PROMPT, params, firsts, None, [])
        running = await worker.loop.call(lambda e: sorted(e.scheduler.requests))
        await worker.abort("g-0")
        return refused, running, await _held(worker)
    refused, running, after = drive("decode", body)
    assert refused["pinned"] == 0 and refused["in_use"] == 0, refused
    assert running == ["g-0"]
    assert not after["unfinished"] and after["in_use"] == 0 and after["pinned"] == 0, after
