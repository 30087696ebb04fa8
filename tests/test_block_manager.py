"""BlockManager: allocation, reference counts, prefix caching with LRU eviction, integrity."""

import pytest

from engine.core.block_manager import BlockManager, chain_hashes, prefix_block_hashes


def test_allocate_grows_tables_with_low_contiguous_ids_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    assert bm.allocate("a", 9)  # 3 blocks
    assert bm.table("a") == [0, 1, 2]
    assert bm.allocate("a", 12)  # still 3 blocks
    assert bm.allocate("a", 13)
    assert bm.table("a") == [0, 1, 2, 3]
    assert bm.allocate("b", 16)
    assert bm.table("b") == [4, 5, 6, 7]
    assert not bm.allocate("c", 1)  # full: nothing changes
    assert not bm.has_table("c")
    bm.free("a")
    assert bm.check_integrity() == {"free": 4, "cached": 0, "used": 4, "total": 8}
    assert bm.allocate("c", 5) and bm.table("c") == [0, 1]


def test_prefix_hits_share_blocks_and_keep_one_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert bm.allocate("a", len(prompt))
    bm.cache_full_blocks("a", prompt, len(prompt))
    hits = bm.cached_prefix(prompt)
    assert hits == bm.table("a")[:2]
    assert bm.allocate("b", len(prompt), hits)
    assert bm.table("b")[:2] == hits and bm.table("b")[2] not in bm.table("a")
    bm.check_integrity()
    # a prompt of exactly 8 tokens may reuse only the first block: its last token must be computed
    assert bm.cached_prefix(prompt[:8]) == hits[:1]
    # a different first block breaks the chain even if the second block's tokens match
    assert bm.cached_prefix([0] + prompt[1:]) == []


def test_freed_hashed_blocks_are_cached_then_evicted_least_recently_used_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    for owner, base in (("a", 0), ("b", 10)):
        tokens = [base, base + 1, base + 2]
        assert bm.allocate(owner, 3)
        bm.cache_full_blocks(owner, tokens, 3)
    bm.free("a")  # a's first block becomes cached, its partial block free
    bm.free("b")
    counts = bm.check_integrity()
    assert counts["cached"] == 2 and counts["free"] == 2 and bm.num_free_blocks == 4
    # a hit revives the cached block: it is used again, not evictable
    hit = bm.cached_prefix([0, 1, 99])
    assert bm.allocate("c", 3, hit)
    assert bm.num_cached_blocks == 1
    # fill everything: the remaining cached block (b's) is evicted and its hash forgotten
    assert bm.allocate("d", 4)
    assert bm.num_cached_blocks == 0
    assert bm.cached_prefix([10, 11, 12]) == []
    assert bm.cached_prefix([0, 1, 2]) == hit
    bm.check_integrity()


def test_shared_block_is_freed_only_when_its_last_owner_leaves():
    bm = BlockManager(num_blocks=4, block_size=2)
    assert bm.allocate("a", 3)
    bm.cache_full_blocks("a", [1, 2, 3], 3)
    hit = bm.cached_prefix([1, 2, 3])
    assert bm.allocate("b", 3, hit)
    bm.free("a")
    assert bm.num_cached_blocks == 0  # still held by b
    bm.free("b")
    assert bm.num_cached_blocks == 1
    assert bm.check_integrity()["used"] == 0


def test_allocation_with_prefix_accounts_for_revived_cached_blocks():
    bm = BlockManager(num_blocks=2, block_size=2)
    assert bm.allocate("a", 2)
    bm.cache_full_blocks("a", [5, 6], 2)
    bm.free("a")
    hit = bm.cached_prefix([5, 6, 7])
    # 3 tokens need 2 blocks: one revived from the cache, one fresh (the only free one)
    assert bm.allocate("b", 3, hit)
    assert not bm.allocate("c", 1)
    bm.check_integrity()


def test_prefix_hashes_chain_over_parents():
    a = prefix_block_hashes([1, 2, 3, 4], 2)
    b = prefix_block_hashes([9, 9, 3, 4], 2)
    assert len(a) == 2 and a[1] != b[1]  # same tokens, different parent
    assert prefix_block_hashes([1, 2, 3], 2) == a[:1]


def test_integrity_detects_a_corrupted_reference_count():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4)
    bm._blocks[bm.table("a")[0]].ref_count += 1
    with pytest.raises(AssertionError, match="ref_count"):
        bm.check_integrity()


def test_chained_block_hashes_are_stable_values():
    """The hashes routing and the prefix cache share: blake2b-128 of the parent's hash (b"root" first) and the
    block's ids as int64, each block chained to the one before; the same values however the ids are split."""
    import hashlib

    import numpy as np

    ids = list(range(100, 100 + 37))
    want, parent = [], b"root"
    for start in range(0, 36, 4):
        h = hashlib.blake2b(digest_size=16)
        h.update(parent)
        h.update(np.asarray(ids[start:start + 4], dtype=np.int64).tobytes())
        parent = h.digest()
        want.append(parent)
    assert prefix_block_hashes(ids, 4) == want
    assert chain_hashes(want[2], ids[12:37], 4) == want[3:]
