"""A collocated Worker driven through its stream (decode_pool.worker_stream) in this process, on the real tiny
engine and real sockets: a "generate" command streams the same tokens as the engine alone, an "abort" behind it on
the stream ends the request (the abort never overtakes the start: both travel one stream, in order), and a command
the engine refuses comes back on the stream under its request id (as a Ray call's error did), with nothing left
running. The Ray backend's side of it is every collocated serving test's."""

import asyncio

from decode_pool.step_delta import StepDelta
from decode_pool.worker_stream import StreamLink
from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig
from pool_worker.worker import Worker

PROMPT = list(range(3, 3 + 40))
SHORT = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)  # still running when the test aborts it


def drive(body):
    async def main():
        worker = Worker("decode-t", EngineConfig(model="tiny", max_num_seqs=4), None, 1, 5.0, role="collocated",
                        stream=True)
        info = await worker.start()
        link = StreamLink(*info.outputs_at)
        batches: asyncio.Queue = asyncio.Queue()

        async def read():
            async for batch in link.batches():
                batches.put_nowait(batch)
        reader = asyncio.create_task(read())
        try:
            while not link.connected:
                await asyncio.sleep(0.01)
            return await asyncio.wait_for(body(worker, link, batches), 60)
        finally:
            reader.cancel()
            await worker.shutdown()
    return asyncio.run(main())


async def until(batches: asyncio.Queue, done) -> tuple[dict[str, list[StepDelta]], dict[str, str]]:
    """Every delta and refusal on the stream until done(deltas, failed) holds."""
    deltas: dict[str, list[StepDelta]] = {}
    failed: dict[str, str] = {}
    while not done(deltas, failed):
        outputs, _, _, refused = await batches.get()
        for fields in outputs:
            deltas.setdefault(fields[0], []).append(StepDelta(*fields))
        failed.update(refused)
    return deltas, failed


def test_generate_streams_the_engines_tokens_and_an_abort_behind_it_ends_it():
    expected = LLM("tiny").generate([PROMPT], SHORT)[0].token_ids

    async def body(worker, link, batches):
        link.send(("generate", "short", PROMPT, SHORT, [], 0))
        link.send(("generate", "long", PROMPT, LONG, [], 0))
        deltas, failed = await until(batches, lambda d, f: any(x.finish_reason for x in d.get("short", []))
                                     and len(d.get("long", [])) >= 3)
        link.send(("abort", "long"))
        for _ in range(200):  # the abort reaches the engine through the worker's event loop
            if not await worker.loop.call(lambda e: e.has_unfinished()):
                break
            await asyncio.sleep(0.02)
        return deltas, failed, await worker.loop.call(lambda e: (e.has_unfinished(), e.check_integrity()))
    deltas, failed, (unfinished, integrity) = drive(body)
    assert [t for x in deltas["short"] for t in x.new_token_ids] == expected and not failed
    assert not any(x.finish_reason for x in deltas["long"])
    assert not unfinished and integrity["in_use"] == 0


def test_a_command_the_engine_refuses_comes_back_on_the_stream():
    async def body(worker, link, batches):
        link.send(("generate", "twice", PROMPT, LONG, [], 0))
        link.send(("generate", "twice", PROMPT, LONG, [], 0))  # an id in use: add_request's ValueError
        link.send(("generate", "bad", PROMPT, SHORT, [], "high"))  # priority must be an int
        _, failed = await until(batches, lambda d, f: len(f) == 2)
        link.send(("abort", "twice"))
        for _ in range(200):
            if not await worker.loop.call(lambda e: e.has_unfinished()):
                break
            await asyncio.sleep(0.02)
        return failed, await worker.loop.call(lambda e: (e.has_unfinished(), e.check_integrity()))
    failed, (unfinished, integrity) = drive(body)
    assert "already in use" in failed["twice"] and "priority must be an int" in failed["bad"]
    assert not unfinished and integrity["in_use"] == 0
