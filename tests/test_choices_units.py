"""Units of n choices: the block manager's copy-on-write fork (reference counts, integrity, the partial block
copied) and the per-choice seeds (engine.choices)."""

from __future__ import annotations

import pytest

from engine.core.block_manager import BlockManager
from engine.core.choices import choice_params, choice_seed
from engine.core.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.9, seed=77)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 10)  # 3 blocks: 2 full, 1 partial (2 tokens)
    a = bm.table("a")
    copies = bm.fork("a", "b", 10)
    assert bm.table("b")[:2] == a[:2] and bm.table("b")[2] != a[2] and copies == [(a[2], bm.table("b")[2])]
    assert bm.fork("a", "c", 8) == [] and bm.table("c") == a[:2]  # a whole number of blocks: nothing to copy
    counts = bm.check_integrity()
    assert counts["used"] == 4 and [bm._blocks[b].ref_count for b in a] == [3, 3, 1]
    assert bm.allocate("b", 13)  # b grows in its own blocks only
    assert bm.table("b")[:2] == a[:2] and len(set(bm.table("b")) & set(a)) == 2
    for owner in ("a", "b", "c"):
        bm.free(owner)
        bm.check_integrity()
    assert bm.num_free_blocks == 8
    full = BlockManager(num_blocks=3, block_size=4)
    assert full.allocate("a", 10)
    assert full.fork("a", "b", 10) is None and not full.has_table("b")  # no block for the copy: nothing changes
    assert full.fork("a", "b", 8) == []  # shares only: needs none
    full.check_integrity()


def test_choice_seeds_follow_vllm_and_stay_in_range():
    assert [p.seed for p in choice_params(PARAMS, 3)] == [77, 78, 79]
    assert choice_seed(2**63 - 1, 1) == 0 and choice_seed(None, 5) is None
    assert [p.seed for p in choice_params(SamplingParams(), 2)] == [None, None]
    with pytest.raises(ValueError, match="n must be"):
        choice_params(PARAMS, 0)
