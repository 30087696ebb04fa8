"""The host tier under the engine's prefix cache (engine.core.host_tier, engine.runner.host_tier_store).

- Bookkeeping: stores take free slots then the least recently used entry's, never one a copy back reads in the step
  being planned; lookups find the longest run; every slot is accounted for; the fleet's hints list adds and evictions.
- Offline, a device cache too small for a conversation and the prompts between its turns: the second turn's history
  (evicted from the device) is copied back from the host tier, counted (hits, bytes, the request's cached and
  restored tokens, its restore timer), and its output equals a cold engine's (greedy and seeded).
- A flood of distinct prompts through a small tier: its bytes stay within its size, it evicts, every slot and block
  is accounted for after every step.
- On a GPU (`bash benchmarks/gpu_run.sh tests`) the same engine tests run the CUDA path: pinned host slots, copies
  on the copy stream.
- Settings: 0 turns it off, a size under one block, a negative one or one with tensor parallelism is refused.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.host_tier import HostTier
from engine.engine_config import EngineConfig
from tests.engine_helpers import random_prompts, run_alone

# The engine tests run on a GPU where there is one (the tier's pinned host slots and copy stream), else the CPU
pytestmark = pytest.mark.gpu
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 2000
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)


def test_the_tier_stores_finds_and_evicts_least_recently_used_never_a_slot_being_read():
    tier = HostTier(num_slots=3, block_bytes=100)
    assert tier.store([(5, b"a"), (6, b"b"), (7, b"c")]) == [(5, 0), (6, 1), (7, 2)]
    assert tier.store([(8, b"a")]) == []  # held already: nothing copied, "a" now most recently used
    tier.end_step()  # the step's copies are queued
    assert tier.find([b"a", b"b", b"x", b"c"]) == [0, 1]
    assert tier.take([b"b"], looked_up=3) == [1]  # "b" is read this step
    assert (tier.hits, tier.misses) == (1, 2)
    # full: "c" is the least recently used ("a" was touched, "b" taken); then "a"; "b" is read this step and "d",
    # "e" are written: "f" finds no slot
    assert tier.store([(9, b"d"), (10, b"e"), (11, b"f")]) == [(9, 2), (10, 0)]
    assert tier.dropped == 1 and tier.evictions == 2
    assert tier.check_integrity() == {"free": 0, "cached": 3, "busy": 3, "total": 3}
    tier.end_step()
    assert tier.store([(12, b"g")]) == [(12, 1)]  # "b" (least recently used) may go now
    added, removed = tier.take_changes()  # net: "c", "a" and "b" were stored, then evicted
    assert added == [b"d", b"e", b"g"] and removed == [b"a", b"b", b"c"]
    assert tier.take_changes() == ([], [])
    tier.clear()
    assert tier.check_integrity()["free"] == 3 and tier.find([b"d"]) == []


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_an_evicted_history_comes_back_from_the_host_tier_exactly(checkpoints, params):
    folder = str(checkpoints.tiny())
    turn1, *others = random_prompts((40, 40, 40, 40), VOCAB, seed=44)
    # 8 device blocks (128 tokens): turn 1 (52 tokens) then three other 52-token requests evict its blocks
    engine = LLM(folder, device=DEVICE, num_kv_blocks=8, kv_host_cache_bytes=64 << 20).engine
    reply, _ = run_alone(engine, "t1", turn1, params)
    for i, other in enumerate(others):
        run_alone(engine, f"o{i}", other, params)
    turn2 = turn1 + reply + random_prompts((9,), VOCAB, seed=45)[0]  # the history resent with a new message
    assert engine.block_manager.cached_prefix(turn2) == []  # gone from the device
    got, first = run_alone(engine, "t2", turn2, params)
    load = engine.load()
    # 61 tokens: 3 full blocks before the last token, all of them turn 1's (52 tokens of history)
    assert first.num_cached_tokens == 48 and load.host_tier_hit_blocks_total == 3
    assert load.host_tier_out_bytes_total == 3 * engine.host_tier.block_bytes
    assert load.host_tier_in_bytes_total >= 3 * engine.host_tier.block_bytes
    assert load.prefix_hit_tokens_total == 0 and load.host_tier_hit_tokens_total == 48  # all of it from the host
    cold = LLM(folder, device=DEVICE, num_kv_blocks=8, kv_host_cache_bytes=0).engine
    assert cold.host_tier is None
    expected, cold_first = run_alone(cold, "t2", turn2, params)
    assert got == expected and cold_first.num_cached_tokens == 0
    assert engine.check_integrity()["host_free"] + engine.check_integrity()["host_cached"] == engine.host_tier.num_slots


def test_the_restore_is_timed_for_its_request(checkpoints):
    folder = str(checkpoints.tiny())
    prompt, other = random_prompts((40, 100), VOCAB, seed=46)
    engine = LLM(folder, device=DEVICE, num_kv_blocks=8, kv_host_cache_bytes=64 << 20).engine
    run_alone(engine, "a", prompt, GREEDY)
    run_alone(engine, "b", other, GREEDY)  # 112 tokens: 7 of the 8 blocks; "a"'s first block is the last one evicted
    engine.add_request("c", prompt + [5, 6], GREEDY)
    req = engine.scheduler.requests["c"]
    engine.step()
    # its 2 full blocks before the last token: the first from the device, the second from the host tier
    assert req.num_restored_tokens == 16 and req.num_cached_tokens == 32
    assert req.restore_timer is not None and req.restore_timer.seconds() >= 0


def test_a_flood_keeps_the_tier_within_its_bytes_and_every_slot_accounted_for(checkpoints):
    folder = str(checkpoints.tiny())
    probe = LLM(folder, device=DEVICE, num_kv_blocks=6, kv_host_cache_bytes=1 << 20).engine
    block_bytes = probe.host_tier.block_bytes
    engine = LLM(folder, device=DEVICE, num_kv_blocks=6, kv_host_cache_bytes=5 * block_bytes + 1).engine
    assert engine.host_tier.num_slots == 5
    llm_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(random_prompts([36] * 10, VOCAB, seed=47)):
        engine.add_request(f"f{i}", prompt, llm_params)
    while engine.has_unfinished():
        engine.step()
        counts = engine.check_integrity()
        assert counts["host_cached"] <= 5
    load = engine.load()
    assert load.host_tier_used_bytes <= load.host_tier_capacity_bytes == 5 * block_bytes
    assert load.host_tier_evictions_total > 0 and load.host_tier_used_blocks == 5


def test_settings_are_checked(checkpoints):
    folder = str(checkpoints.tiny())
    # 0 turns it off; auto with no prefix cache: no tier
    assert LLM(folder, device="cpu", kv_host_cache_bytes=0).engine.host_tier is None
    assert LLM(folder, device="cpu", enable_prefix_caching=False).engine.host_tier is None
    with pytest.raises(ValueError, match="kv_host_cache_bytes 100 holds no KV block"):
        LLM(folder, device="cpu", kv_host_cache_bytes=100)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="kv_host_cache_bytes"):
            EngineConfig(kv_host_cache_bytes=bad)
    with pytest.raises(ValueError, match="kv_host_cache_bytes"):
        EngineConfig(kv_host_cache_bytes=1 << 20, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="kv_host_cache_bytes"):
        EngineConfig(kv_host_cache_bytes=1 << 20, enable_prefix_caching=False)


def test_fp8_blocks_go_down_and_back_at_their_own_size(checkpoints):
    """kv_cache_dtype fp8: the tier's slots are the fp8 cache's blocks (half the bfloat16 bytes), copied as they are:
    the restored turn equals a cold fp8 engine's."""
    folder = str(checkpoints.tiny())
    turn1, *others = random_prompts((40, 40, 40, 40), VOCAB, seed=48)
    kw = dict(dtype="bfloat16", num_kv_blocks=8)
    engine = LLM(folder, device=DEVICE, kv_cache_dtype="fp8", kv_host_cache_bytes=64 << 20, **kw).engine
    wide = LLM(folder, device=DEVICE, kv_host_cache_bytes=64 << 20, **kw).engine
    assert engine.host_tier.block_bytes * 2 == wide.host_tier.block_bytes
    assert engine.host_tier_store.copies.host.dtype == engine.kv_cache.dtype
    reply, _ = run_alone(engine, "t1", turn1, GREEDY)
    for i, other in enumerate(others):
        run_alone(engine, f"o{i}", other, GREEDY)
    turn2 = turn1 + reply + [11, 12, 13]
    got, first = run_alone(engine, "t2", turn2, GREEDY)
    assert first.num_cached_tokens == 48 and engine.load().host_tier_hit_blocks_total == 3
    cold = LLM(folder, device=DEVICE, kv_cache_dtype="fp8", kv_host_cache_bytes=0, **kw).engine
    assert got == run_alone(cold, "t2", turn2, GREEDY)[0]


def test_the_automatic_size_shares_the_node_s_memory_between_its_gpus(tmp_path):
    from engine.runner.host_tier_store import auto_host_cache_bytes
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       268435456 kB\nMemAvailable:   209715200 kB\n")  # 200 GiB available
    gpus = tmp_path / "gpus"
    gpus.mkdir()
    for i in range(8):
        (gpus / f"0000:{i:02x}:00.0").mkdir()
    assert auto_host_cache_bytes("cuda", str(meminfo), str(gpus)) == int((200 << 30) * 0.2 / 8)  # 5 GiB each
    assert auto_host_cache_bytes("cuda", str(meminfo), str(tmp_path / "none")) == 32 << 30  # one GPU: capped
    assert auto_host_cache_bytes("cpu", str(meminfo), str(gpus)) == 1 << 30
    assert auto_host_cache_bytes("cpu", str(tmp_path / "missing")) == 0


def test_a_restore_is_weighed_against_computing_the_blocks():
    """engine.core.copy_cost: copied back while the copy is the cheaper (or a rate is unmeasured), else computed."""
    tier = HostTier(num_slots=4, block_bytes=1 << 20)  # 1 MiB blocks of 16 tokens
    assert tier.worth_restoring([0, 1], 16) == [0, 1]  # nothing measured yet: copy
    tier.cost.copy_bytes_per_s = 10e9  # 2 MiB: ~0.2 ms
    tier.cost.observe_prefill(1000, 0.1)  # 100 us a token: 32 tokens 3.2 ms
    assert tier.worth_restoring([0, 1], 16) == [0, 1]
    tier.cost.copy_bytes_per_s = 1e8  # ~21 ms
    assert tier.worth_restoring([0, 1], 16) == [] and tier.chose_recompute == 2


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_history_whose_copy_costs_more_than_its_recompute_is_computed_exactly(checkpoints, params):
    """The engine measures the copy bandwidth at start and times its prompt steps; with the copy made to look slow,
    the evicted history is computed again instead of restored, and the output is the same."""
    folder = str(checkpoints.tiny())
    turn1, *others = random_prompts((40, 40, 40, 40), VOCAB, seed=44)
    engine = LLM(folder, device=DEVICE, num_kv_blocks=8, kv_host_cache_bytes=64 << 20).engine
    assert engine.host_tier.cost is engine.copy_cost and engine.copy_cost.copy_bytes_per_s > 0
    reply, _ = run_alone(engine, "t1", turn1, params)
    for i, other in enumerate(others):
        run_alone(engine, f"o{i}", other, params)
    assert engine.copy_cost.prefill_token_s > 0  # timed from the prompt steps above
    engine.copy_cost.copy_bytes_per_s = 1.0  # a byte a second: no copy pays
    turn2 = turn1 + reply + random_prompts((9,), VOCAB, seed=45)[0]
    got, first = run_alone(engine, "t2", turn2, params)
    assert first.num_cached_tokens == 0 and engine.host_tier.chose_recompute == 3
    assert engine.load().host_tier_hit_blocks_total == 0 and engine.load().host_tier_recompute_blocks_total == 3
    cold = LLM(folder, device=DEVICE, num_kv_blocks=8, kv_host_cache_bytes=0).engine
    assert got == run_alone(cold, "t2", turn2, params)[0]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_decode_booking_restores_the_history_its_host_tier_holds(checkpoints, params):
    """Disaggregated on two engines: the decode engine's host tier holds a conversation's first turn (handed over,
    decoded, then evicted from its device by other requests); the second turn's booking copies those blocks back
    from the tier instead of having them written from outside, and decodes what a single engine does."""
    from tests.engine_helpers import prefill_then_hand_over

    folder = str(checkpoints.tiny())
    turn1, *others = random_prompts((40, 40, 40, 40), VOCAB, seed=47)
    prefill = LLM(folder, device=DEVICE, num_kv_blocks=64, kv_host_cache_bytes=0).engine
    decode = LLM(folder, device=DEVICE, num_kv_blocks=8, kv_host_cache_bytes=64 << 20).engine
    reply = prefill_then_hand_over(prefill, decode, [turn1], [params], tag="t1-", reuse_prefix=True)["t1-0"]
    for i, other in enumerate(others):
        run_alone(decode, f"o{i}", other, params)
    turn2 = turn1 + reply + random_prompts((9,), VOCAB, seed=48)[0]  # 61 tokens: 3 full blocks before the last
    assert decode.block_manager.cached_prefix(turn2) == []  # gone from the decode engine's device
    hits_before = decode.load().host_tier_hit_blocks_total
    got = prefill_then_hand_over(prefill, decode, [turn2], [params], tag="t2-", reuse_prefix=True)["t2-0"]
    assert decode.load().host_tier_hit_blocks_total - hits_before == 3  # restored: not written from outside
    assert decode.check_integrity()["in_use"] == 0
    single = LLM(folder, device=DEVICE, num_kv_blocks=64, kv_host_cache_bytes=0).engine
    assert got == run_alone(single, "t2", turn2, params)[0]


def test_conversations_handed_over_into_a_small_decode_cache_decode_exactly_turn_after_turn(checkpoints):
    """Six conversations, three turns each, handed over into a decode engine of 12 device blocks with a host tier:
    each booking restores its history from the tier into blocks that evicted other conversations' cached blocks.
    Those blocks were copied down after the restore had overwritten them, so the tier kept one conversation's KV
    under another's hashes, and 7 of 18 turns decoded other tokens than a single engine's; every turn now equals
    it."""
    from tests.engine_helpers import prefill_then_hand_over

    folder = str(checkpoints.tiny())
    prompts = random_prompts([40 + 3 * i for i in range(6)], VOCAB, seed=5)
    prefill = LLM(folder, device=DEVICE, num_kv_blocks=256, kv_host_cache_bytes=0).engine
    decode = LLM(folder, device=DEVICE, num_kv_blocks=12, kv_host_cache_bytes=64 << 20).engine
    single = LLM(folder, device=DEVICE, num_kv_blocks=256, kv_host_cache_bytes=0, enable_prefix_caching=False)
    for turn in range(3):
        for c in range(6):
            tag = f"t{turn}c{c}-"
            got = prefill_then_hand_over(prefill, decode, [prompts[c]], [GREEDY], tag=tag, reuse_prefix=True)
            want = single.generate([prompts[c]], GREEDY)[0].token_ids
            assert got[f"{tag}0"] == list(want), (turn, c)
            prompts[c] = prompts[c] + list(want) + random_prompts([7], VOCAB, seed=100 + 10 * turn + c)[0]
    assert decode.load().host_tier_hit_blocks_total > 0  # histories came back from the tier
    assert decode.check_integrity()["in_use"] == 0


def test_swapped_requests_and_the_host_tier_together_decode_exactly():
    """preemption_mode swap beside the host tier: a resumed request is swapped into blocks that may have evicted
    cached ones in the same step. Those were copied down to the tier after the swap-in had overwritten them (7 of 30
    outputs differed from a single engine's over three turns of ten prompts); now first."""
    prompts = random_prompts([40 + 5 * i for i in range(10)], VOCAB, seed=9)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = LLM("tiny", device=DEVICE, num_kv_blocks=24, kv_host_cache_bytes=64 << 20, preemption_mode="swap",
                 max_num_seqs=8)
    single = LLM("tiny", device=DEVICE, num_kv_blocks=512, kv_host_cache_bytes=0, enable_prefix_caching=False)
    for turn in range(3):
        want = single.generate(prompts, params)
        assert [o.token_ids for o in engine.generate(prompts, params)] == [w.token_ids for w in want], turn
        prompts = [p + list(w.token_ids) + random_prompts([5], VOCAB, seed=200 + 10 * turn + c)[0]
                   for c, (p, w) in enumerate(zip(prompts, want, strict=True))]
    load = engine.engine.load()
    assert load.swapped_out_total > 0 and load.host_tier_hit_blocks_total > 0  # both paths ran
    assert engine.engine.check_integrity()["in_use"] == 0


def test_a_tier_still_being_built_joins_between_steps_and_serves_exactly_from_then_on(checkpoints, monkeypatch):
    """A CUDA server's tier is pinned on a thread of its own while the engine serves (engine.host_kv): until it
    joins, the engine runs as one without a tier; it joins at the first step after its build, and from then on an
    evicted history comes back from it. The build is held here by a gate (on the CPU it is instant)."""
    import threading

    import engine.host_kv as host_kv

    folder = str(checkpoints.tiny())
    turn1, *others = random_prompts((40, 40, 40, 40), VOCAB, seed=51)
    engine = LLM(folder, device=DEVICE, num_kv_blocks=8, kv_host_cache_bytes=0).engine
    gate, build = threading.Event(), host_kv._build_host_tier
    monkeypatch.setattr(host_kv, "_build_host_tier", lambda *a: gate.wait(60) and build(*a))
    engine._start_host_tier(replace(engine.config, kv_host_cache_bytes=64 << 20), engine.copy_cost)
    reply, _ = run_alone(engine, "t1", turn1, GREEDY)  # served while the tier is built
    assert engine.host_tier is None and engine.block_manager.take_evicted() == []
    gate.set()
    engine._tier_build.result(timeout=60)
    for i, other in enumerate(others):  # the first step joins it; these evict turn 1's blocks into it
        run_alone(engine, f"o{i}", other, GREEDY)
    assert engine.host_tier is not None and engine.scheduler.tier is engine.host_tier
    turn2 = turn1 + reply + random_prompts((9,), VOCAB, seed=52)[0]
    got, first = run_alone(engine, "t2", turn2, GREEDY)
    assert first.num_cached_tokens == 48 and engine.load().host_tier_hit_blocks_total == 3
    cold = LLM(folder, device=DEVICE, num_kv_blocks=8, kv_host_cache_bytes=0).engine
    assert got == run_alone(cold, "t2", turn2, GREEDY)[0]
    assert engine.check_integrity()["host_free"] + engine.check_integrity()["host_cached"] == engine.host_tier.num_slots
