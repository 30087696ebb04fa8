"""The structured-output tables built off the engine thread (engine.sampling.grammar_loader), on the real `tiny`
engine: structured requests that arrive while the loader builds are held (add_request's and a hand-over's
add_prefilled_request's, its booked blocks kept) while every other request steps on, then start in arrival order
and give valid JSON; a held request can be aborted; a loader that fails ends the held requests with "error" and
frees what they held. A pool Worker (in this process, with its real stream) starts the loader once it is started,
on a thread of its own, and reports its start phases. The loader's build here is the engine's own, run once a test
lets it (so a test decides when the tables are ready, not a race)."""

import asyncio
import json
import threading
import time

import jsonschema
import pytest

from decode_pool.step_delta import StepDelta
from decode_pool.worker_stream import StreamLink
from engine import LLM, SamplingParams
from engine.engine_config import EngineConfig
from engine.sampling.grammar_loader import GrammarLoader
from engine.sampling.structured import StructuredSpec
from pool_worker.worker import Worker

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}
JSON = SamplingParams(temperature=0, max_tokens=40, structured=StructuredSpec.json_schema(SCHEMA))
PLAIN = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
PROMPT = list(range(3, 3 + 20))


class Gate:
    """A loader build that waits until opened, then builds the engine's real GrammarManager; records its thread."""

    def __init__(self, engine) -> None:
        self.engine, self.opened, self.threads = engine, threading.Event(), []

    def __call__(self):
        self.threads.append(threading.current_thread().name)
        if not self.opened.wait(60):
            raise TimeoutError("the test never opened the gate")
        return self.engine._build_grammar()


def gated_engine():
    engine = LLM("tiny").engine
    gate = Gate(engine)
    engine.grammar_loader = GrammarLoader(gate)
    return engine, gate


def loaded(engine) -> None:
    """Until the engine's loader has ended (it builds on its own thread; stepping meanwhile only re-checks)."""
    for _ in range(6000):
        if engine.grammar_loader.done():
            return
        time.sleep(0.01)
    raise TimeoutError("the grammar loader did not end")


def run(engine, outputs: dict, until=lambda: False, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if until() or not engine.has_unfinished():
            return
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_a_held_structured_request_waits_while_the_others_step_then_gives_valid_json():
    engine, gate = gated_engine()
    outputs: dict = {}
    engine.add_request("plain", PROMPT, PLAIN)
    engine.add_request("json", PROMPT, JSON)  # returns at once: nothing is built on this thread
    assert engine.load().num_waiting == 2  # the held one counts as waiting
    run(engine, outputs, until=lambda: len(tokens(outputs.get("plain", []))) >= 20)
    assert len(tokens(outputs["plain"])) >= 20 and "json" not in outputs  # the engine stepped on without it
    assert engine.grammar is None and engine.load().num_waiting == 1
    assert engine.check_integrity()["in_use"] > 0
    gate.opened.set()
    loaded(engine)
    run(engine, outputs)
    assert tokens(outputs["plain"]) == LLM("tiny").generate([PROMPT], PLAIN)[0].token_ids
    assert outputs["json"][-1].finish_reason == "stop"
    jsonschema.validate(json.loads(engine.tokenizer.decode(tokens(outputs["json"]))), SCHEMA)
    assert gate.threads == ["grammar-load"] and threading.current_thread().name != "grammar-load"
    assert engine.load().grammar_load_s > 0
    integrity = engine.check_integrity()
    assert integrity["in_use"] == integrity["pinned"] == 0


def test_a_held_hand_over_keeps_its_blocks_and_starts_after_the_loader_and_a_held_request_can_be_aborted():
    engine, gate = gated_engine()
    # what a prefill worker sampled first under the grammar: "{" starts every object
    first = engine.tokenizer.encode("{", add_special_tokens=False)[0]
    blocks = engine.reserve_blocks("handed", len(PROMPT))
    assert blocks is not None and len(blocks) == -(-len(PROMPT) // engine.config.block_size)  # the prompt's blocks
    assert engine.add_prefilled_request("handed", PROMPT, first, JSON) is None  # held, its blocks still booked
    engine.add_request("gone", PROMPT, JSON)
    assert engine.check_integrity()["pinned"] == len(blocks)  # a reservation's blocks: booked, not in use
    for taken in ("gone", "handed"):  # held, or booked: either id is in use, for any request
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(taken, PROMPT, JSON)
    assert engine.abort("gone") and not engine.abort("gone")
    outputs: dict = {}
    run(engine, outputs, max_steps=5)
    assert not outputs and engine.check_integrity()["pinned"] == len(blocks)
    gate.opened.set()
    loaded(engine)
    run(engine, outputs)
    text = engine.tokenizer.decode([first, *tokens(outputs["handed"])])
    assert outputs["handed"][-1].finish_reason == "stop" and "gone" not in outputs
    jsonschema.validate(json.loads(text), SCHEMA)
    integrity = engine.check_integrity()
    assert integrity["in_use"] == integrity["pinned"] == 0


def test_a_failed_load_ends_the_held_requests_with_error_and_frees_their_blocks():
    engine = LLM("tiny").engine
    opened = threading.Event()

    def broken():
        opened.wait(60)
        raise RuntimeError("the tokenizer tables could not be built")
    engine.grammar_loader = GrammarLoader(broken)
    engine.reserve_blocks("handed", len(PROMPT))
    engine.add_prefilled_request("handed", PROMPT, 5, JSON)
    engine.add_request("fresh", PROMPT, JSON, prefill_only=True)
    engine.add_request("plain", PROMPT, PLAIN)
    opened.set()
    loaded(engine)
    outputs: dict = {}
    run(engine, outputs)
    assert [o.finish_reason for o in outputs["handed"]] == ["error"]
    assert [(o.finish_reason, o.prefill_only) for o in outputs["fresh"]] == [("error", True)]
    assert outputs["plain"][-1].finish_reason == "length"
    with pytest.raises(ValueError, match="could not be built"):  # a later one is refused at once, naming why
        engine.add_request("later", PROMPT, JSON)
    integrity = engine.check_integrity()
    assert integrity["in_use"] == integrity["pinned"] == 0 and not engine.has_unfinished()


def test_a_started_worker_builds_the_tables_on_their_own_thread_and_reports_its_start_phases():
    async def main():
        worker = Worker("decode-g", EngineConfig(model="tiny", max_num_seqs=4), None, 1, 5.0, role="collocated",
                        stream=True)
        info = await worker.start()
        link = StreamLink(*info.outputs_at)
        deltas: dict[str, list[StepDelta]] = {}

        async def read():
            async for outputs, _, _, refused in link.batches():
                assert not refused, refused
                for fields in outputs:
                    deltas.setdefault(fields[0], []).append(StepDelta(*fields))
        reader = asyncio.create_task(read())
        try:
            while not link.connected:
                await asyncio.sleep(0.01)
            link.send(("generate", "plain", PROMPT, PLAIN, [], 0))
            link.send(("generate", "json", PROMPT, JSON, [], 0))
            while not all(any(d.finish_reason for d in deltas.get(r, [])) for r in ("plain", "json")):
                await asyncio.sleep(0.02)
            engine = worker.loop.engine
            return info, deltas, engine.grammar_loader.thread, await worker.load(), engine.tokenizer
        finally:
            reader.cancel()
            await worker.shutdown()
    info, deltas, thread, load, tokenizer = asyncio.run(asyncio.wait_for(main(), 120))
    phases = dict(info.startup_s)
    assert {"imports", "engine_config", "engine_weights", "engine_kv_cache", "agent"} <= set(phases)
    assert all(s >= 0 for s in phases.values())
    assert thread == "grammar-load" and load.grammar_load_s > 0
    text = tokenizer.decode([t for d in deltas["json"] for t in d.new_token_ids])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert sum(len(d.new_token_ids) for d in deltas["plain"]) == PLAIN.max_tokens
