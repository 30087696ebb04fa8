"""Pushed handoffs on the real tiny engine (prefill_pool.kv_push): a prefill engine, stepped by its AsyncEngine with
KVPushes' layer hook, writes a prompt's KV over real UCX into another process's agent (the decode side's cache),
chunk by chunk and layer group by layer group; the blocks there must then equal the prefill's own, bit for bit.
Also: a target named after the last chunk is too late (that request is pulled), and an abort waits out the writes.
That the decode engine then generates exactly the offline engine's tokens is tests/test_serving_tiny.py's check."""

import asyncio
import pickle

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from kvtransfer import AgentConfig
from kvtransfer.worker_agents import WorkerAgents
from prefill_pool.kv_push import KVPushes
from tests.engine_helpers import random_prompts
from tests.kvtransfer_helpers import PeerProcess, bits

pytestmark = pytest.mark.timeout(180)

CONFIG = {"staging_bytes": 8 << 20, "timeout_s": 20.0, "backends": ("ucx",)}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def pair():
    """A bfloat16 tiny engine prefilling in chunks of 48 tokens with its agent, and a decode-side agent in its own
    process holding a cache of the same layout (random bits until written); connected both ways.
    WorkerAgents opts its process into ucxx's Python futures (kvtransfer.backends.ucx.use_python_futures: one
    event loop per process, as in a pool worker). This is the test process, whose later modules run agents each on
    a loop of its own: ucxx's futures, bound to this module's loop, failed their handshakes ("attached to a
    different loop"). So the test process keeps ucxx's default, as use_python_futures says tests should."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UCXPY_ENABLE_PYTHON_FUTURE", "0")
        yield from _pair()


def _pair():
    engine = LLM("tiny", dtype="bfloat16", max_prefill_chunk=48).engine
    agents = WorkerAgents("prefill-t", AgentConfig(**CONFIG), engine)
    peer = PeerProcess("decode-t", num_blocks=64, seed=5, config=CONFIG, spec=engine.kv_spec)
    try:
        agents.local.agent.add_remote(peer.meta)
        peer.call("add_remote", agents.local.agent.metadata().to_bytes())
        yield engine, agents, peer
    finally:
        peer.close()
        agents.close()


def _prefill(engine, agents, rid: str, prompt: list[int], remote_ids: list[int], name_after_steps: int = 0,
             abort_while_pushing: bool = False, notify: bool = False, skip: int = 0):
    """Prefill `prompt` on an AsyncEngine with the push hook (and, with `notify`, KVPushes.sampled as its step
    hook, as the prefill worker runs it), naming the target after `name_after_steps` of its steps; (target accepted,
    pushed, the request's pinned blocks here, the KVPushes, its first token, the agent finish() left to notify)."""
    pushes = KVPushes(agents.local.agent, engine.config.block_size, engine.model_config.num_layers, 20.0)

    async def main():
        done = asyncio.get_running_loop().create_future()

        def on_outputs(outputs, load):
            for out in outputs:
                if out.request_id == rid and not done.done():
                    done.set_result(out)
        loop = AsyncEngine(engine, on_outputs, pushes.hook, pushes.sampled if notify else None)
        task = asyncio.create_task(loop.run())
        try:
            def add(e) -> bool:  # the target with the request: nothing of it can run before
                e.add_request(rid, prompt, GREEDY, prefill_only=True)
                assert pushes.expect(e, rid)
                return pushes.target(rid, "decode-t", remote_ids, skip) if not name_after_steps else False
            accepted = await loop.call(add)
            if name_after_steps:
                steps = loop.steps
                while loop.steps < steps + name_after_steps:
                    await asyncio.sleep(0.001)
                accepted = pushes.target(rid, "decode-t", remote_ids)
            if abort_while_pushing:
                push = pushes._pushes[rid]
                while not push.handles:  # its first writes are queued
                    await asyncio.sleep(0.001)
                await pushes.settle(loop.call, rid)
                assert rid not in pushes and push.closed and all(h.done() for h in push.handles)
                assert await loop.call(lambda e: e.abort(rid))
                return accepted, False, [], None, None
            out = await done
            pushed, _, to_notify = await pushes.finish(rid)
            await loop.call(lambda e: e.release(rid))
            return accepted, pushed, out.pinned_block_ids, out.new_token_ids[0], to_notify
        finally:
            loop.close()
            await task
    accepted, pushed, local_ids, first, to_notify = asyncio.run(main())
    return accepted, pushed, local_ids, pushes, first, to_notify


def test_a_pushed_prompt_lands_bit_exact_in_the_booked_blocks(pair):
    engine, agents, peer = pair
    # chunks of 48 over blocks of 16: a partial last block after 4 chunks; one chunk; whole blocks only
    for i, (n, remote_ids) in enumerate([(170, list(range(63, 52, -1))), (37, [7, 9, 11]), (64, [20, 21, 22, 23])]):
        prompt = random_prompts([n], 2000, seed=11 + i)[0]
        before = bits(peer.call("blocks", remote_ids)).clone()
        accepted, pushed, local_ids, pushes, _, to_notify = _prefill(engine, agents, f"p{i}", prompt, remote_ids)
        assert accepted and pushed and pushes.pushed == 1 and len(local_ids) == len(remote_ids)
        assert to_notify == "decode-t"  # no step hook here: the worker's fallback notifies
        after = bits(peer.call("blocks", remote_ids))
        assert bits(engine.kv_cache[local_ids]).equal(after) and not after.equal(before)
    ops = agents.local.agent.metrics()["ops"]
    assert ops["write"]["count"] >= 4 * 4 + 4 + 4 and ops["write"]["failures"] == 0  # layer by layer, each chunk
    engine.check_integrity()


def test_the_blocks_the_decode_side_holds_already_are_not_written(pair):
    """A target with skip k (the decode worker's prefix cache holds the prompt's first k blocks): blocks [k, n) land
    bit exact, blocks [0, k) of the target are left as they were, the bytes written are those of n - k blocks;
    a skip that leaves nothing to write is refused."""
    engine, agents, peer = pair
    prompt = random_prompts([170], 2000, seed=40)[0]  # 11 blocks, 4 chunks
    remote_ids, k = list(range(10, 21)), 6
    before = bits(peer.call("blocks", remote_ids)).clone()
    written = agents.local.agent.metrics()["ops"].get("write", {}).get("bytes", 0)
    accepted, pushed, local_ids, pushes, _, _ = _prefill(engine, agents, "sk", prompt, remote_ids, skip=k)
    assert accepted and pushed
    after = bits(peer.call("blocks", remote_ids))
    assert after[:k].equal(before[:k]) and bits(engine.kv_cache[local_ids[k:]]).equal(after[k:])
    per_block = engine.kv_cache[0].numel() * engine.kv_cache.element_size()
    assert agents.local.agent.metrics()["ops"]["write"]["bytes"] - written == (len(remote_ids) - k) * per_block
    accepted, pushed, *_ = _prefill(engine, agents, "sk2", prompt, remote_ids, skip=len(remote_ids))
    assert not accepted and not pushed
    with pytest.raises(ValueError, match="skip must be a non-negative int"):
        pushes.target("sk3", "decode-t", remote_ids, -1)
    engine.check_integrity()


def test_a_target_named_after_the_last_chunk_is_too_late(pair):
    engine, agents, _ = pair
    prompt = random_prompts([40], 2000, seed=20)[0]  # one chunk: done before the target comes
    accepted, pushed, _, pushes, _, _ = _prefill(engine, agents, "late", prompt, [1, 2, 3], name_after_steps=1)
    assert not pushed and pushes.counters() == {"push_completed_total": 0, "push_fallbacks_total": 0,
                                                "push_late_total": 1}
    engine.check_integrity()


def test_an_abort_during_a_push_waits_for_its_writes_before_freeing_the_blocks(pair):
    engine, agents, _ = pair
    prompt = random_prompts([400], 2000, seed=21)[0]  # 9 chunks: the abort comes while they run
    accepted, pushed, *_ = _prefill(engine, agents, "ab", prompt, list(range(30, 55)), abort_while_pushing=True)
    assert accepted and not pushed
    engine.check_integrity()


def test_the_step_hook_notifies_the_decode_agent_once_the_writes_have_landed(pair):
    engine, agents, peer = pair
    prompt = random_prompts([150], 2000, seed=30)[0]  # 4 chunks of 48: writes over several steps
    remote_ids = list(range(40, 50))
    accepted, pushed, local_ids, _, first, to_notify = _prefill(engine, agents, "nt", prompt, remote_ids,
                                                                notify=True)
    assert accepted and pushed and to_notify is None  # notified already: the worker sends nothing more
    got = peer.call("notifications", 20.0)  # waits for the first one
    assert [pickle.loads(m) for m in got["prefill-t"]] == [("pushed", "nt", first, None)]
    # the message left after the writes: every block is in place by now, bit for bit
    assert bits(engine.kv_cache[local_ids]).equal(bits(peer.call("blocks", remote_ids)))
    engine.check_integrity()


def test_no_notification_for_a_late_target(pair):
    engine, agents, peer = pair
    prompt = random_prompts([40], 2000, seed=31)[0]
    accepted, pushed, _, _, _, to_notify = _prefill(engine, agents, "nl", prompt, [4, 5, 6], name_after_steps=1,
                                                    notify=True)
    assert not pushed and to_notify is None
    assert peer.call("notifications", 1.0) == {}
    engine.check_integrity()
