"""Unit tests of the radix prefix cache: matching, splitting, duplicates, locking, LRU eviction."""

import pytest

from deepinfer.engine.block_allocator import BlockAllocator
from deepinfer.engine.radix_cache import RadixCache, RadixCacheError
from deepinfer.errors import DeepInferError


def make(num_blocks=32, page=1, enabled=True):
    alloc = BlockAllocator(num_blocks, page)
    return alloc, RadixCache(alloc, enabled=enabled)


def put(cache, alloc, tokens):
    """Allocate blocks for the full pages of tokens and insert them; returns the blocks."""
    blocks = alloc.allocate(len(tokens) // cache.page_size)
    cache.insert(tokens, blocks)
    return blocks


def test_match_empty_tree_returns_root():
    alloc, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.blocks == [] and m.num_tokens == 0 and m.node is cache.root


def test_insert_then_match_page1_and_split():
    alloc, cache = make()
    blocks = put(cache, alloc, [1, 2, 3, 4, 5])
    assert cache.num_nodes == 1 and cache.total_cached_tokens == 5
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.num_tokens == 3 and m.blocks == blocks[:3]
    # the match ended inside the node: it was split at token 3
    assert cache.num_nodes == 2
    assert m.node.key == [1, 2, 3] and list(m.node.children.values())[0].key == [4, 5]
    full = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert full.num_tokens == 5 and full.blocks == blocks
    cache.check_invariants()


def test_match_page4_only_whole_pages():
    alloc, cache = make(page=4)
    toks = list(range(100, 110))  # 10 tokens -> 2 full pages
    blocks = alloc.allocate(2)
    assert cache.insert(toks, blocks) == 0
    assert cache.total_cached_tokens == 8
    # differs at token 6 (inside page 1): only page 0 matches
    q = toks[:6] + [0, 0, 0]
    m = cache.match_prefix(q)
    assert m.num_tokens == 4 and m.blocks == blocks[:1]
    assert cache.num_nodes == 2  # split at the page boundary
    # query shorter than a page matches nothing
    assert cache.match_prefix(toks[:3]).num_tokens == 0
    # a 7-token query is truncated to one page
    assert cache.match_prefix(toks[:7]).num_tokens == 4
    cache.check_invariants()


def test_max_tokens_caps_match():
    alloc, cache = make(page=2)
    toks = [5, 6, 7, 8, 9, 10]
    blocks = put(cache, alloc, toks)
    m = cache.match_prefix(toks, max_tokens=len(toks) - 1)
    assert m.num_tokens == 4 and m.blocks == blocks[:2]
    assert cache.match_prefix(toks, max_tokens=0).num_tokens == 0
    cache.check_invariants()


def test_insert_duplicates_are_freed_and_shared_blocks_kept():
    alloc, cache = make(num_blocks=16)
    toks = [1, 2, 3, 4]
    first = put(cache, alloc, toks)
    free_before = alloc.num_free
    # a second request computed the same tokens plus two more in blocks of its own
    mine = alloc.allocate(6)
    cached = cache.insert(toks + [5, 6], mine)
    assert cached == 4
    # its first 4 blocks were duplicates (freed); the last 2 are now the tree's
    assert alloc.num_free == free_before - 6 + 4
    assert cache.match_prefix(toks + [5, 6]).blocks == first + mine[4:]
    cache.check_invariants()


def test_insert_with_matched_blocks_frees_nothing():
    alloc, cache = make(num_blocks=16)
    prompt = [1, 2, 3, 4, 5]
    put(cache, alloc, prompt)
    m = cache.match_prefix(prompt + [6, 7], max_tokens=6)
    cache.lock(m.node)
    assert m.num_tokens == 5
    own = alloc.allocate(2)
    free_before = alloc.num_free
    cached = cache.insert(prompt + [6, 7], m.blocks + own)
    cache.unlock(m.node)
    assert cached == 5
    assert alloc.num_free == free_before  # the matched blocks are the tree's: not freed
    assert cache.match_prefix(prompt + [6, 7]).blocks == m.blocks + own
    cache.check_invariants()


def test_insert_rejects_tree_block_at_wrong_page():
    alloc, cache = make()
    blocks = put(cache, alloc, [1, 2, 3])
    with pytest.raises(RadixCacheError, match="owned by the tree"):
        cache.insert([1, 2, 3], [blocks[1], blocks[0], blocks[2]])
    with pytest.raises(RadixCacheError, match="owned by the tree"):
        cache.insert([7, 8], [blocks[0], *alloc.allocate(1)])
    cache.check_invariants()


def test_insert_bad_block_lists():
    alloc, cache = make(page=2)
    b = alloc.allocate(3)
    with pytest.raises(RadixCacheError, match="cover more"):
        cache.insert([1, 2, 3], b[:2])
    with pytest.raises(RadixCacheError, match="repeated"):
        cache.insert([1, 2, 3, 4], [b[0], b[0]])
    with pytest.raises(RadixCacheError, match="not allocated"):
        cache.insert([1, 2], [alloc.num_blocks - 1])
    with pytest.raises(DeepInferError):
        cache.insert([1, 2], [999])


def test_lock_prevents_eviction_and_counters():
    alloc, cache = make()
    a = put(cache, alloc, [1, 2, 3, 4])
    b = put(cache, alloc, [1, 2, 9, 9, 9])  # shares [1, 2]
    assert cache.evictable_blocks == 4 + 3 and cache.protected_blocks == 0
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.node)
    # path [1,2] + [3,4] locked: 4 blocks protected, [9,9,9] evictable
    assert cache.protected_blocks == 4 and cache.evictable_blocks == 3
    assert cache.evict(100) == 3
    assert cache.match_prefix([1, 2, 3, 4]).blocks == a
    assert cache.match_prefix([1, 2, 9]).num_tokens == 2
    cache.unlock(m.node)
    assert cache.evictable_blocks == 4 and cache.protected_blocks == 0
    assert cache.evict(100) == 4
    assert alloc.num_free == alloc.num_blocks and cache.num_nodes == 0
    assert set(b[2:]).isdisjoint(cache._owned)
    cache.check_invariants()


def test_unlock_unlocked_raises():
    alloc, cache = make()
    put(cache, alloc, [1, 2])
    m = cache.match_prefix([1, 2])
    with pytest.raises(RadixCacheError, match="not locked"):
        cache.unlock(m.node)


def test_lock_of_evicted_node_raises():
    alloc, cache = make()
    put(cache, alloc, [1, 2])
    m = cache.match_prefix([1, 2])
    assert cache.evict(2) == 2
    with pytest.raises(RadixCacheError, match="evicted"):
        cache.lock(m.node)
    cache.check_invariants()


def test_lock_survives_later_split():
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.node)
    cache.match_prefix([1, 2, 7])  # splits the locked node
    cache.check_invariants()
    assert cache.protected_blocks == 4
    assert cache.evict(10) == 0
    cache.unlock(m.node)
    assert cache.evictable_blocks == 4
    cache.check_invariants()


def test_peek_is_read_only():
    alloc, cache = make(page=2)
    toks = [1, 2, 3, 4, 5, 6]
    put(cache, alloc, toks)
    put(cache, alloc, [9, 9])
    # [1..6] is the LRU leaf; peeking at it must neither split nor refresh it
    assert cache.peek_prefix_len([1, 2, 3, 4, 7, 7]) == 4
    assert cache.peek_prefix_len(toks, max_tokens=5) == 4
    assert cache.num_nodes == 2
    assert cache.evict(3) == 3
    assert cache.peek_prefix_len(toks) == 0 and cache.peek_prefix_len([9, 9]) == 2
    cache.check_invariants()


def test_lru_order():
    alloc, cache = make()
    put(cache, alloc, [1, 1])
    put(cache, alloc, [2, 2])
    put(cache, alloc, [3, 3])
    cache.match_prefix([1, 1])  # [1,1] is now the most recent; [2,2] the least
    assert cache.evict(2) == 2
    assert cache.match_prefix([2, 2]).num_tokens == 0
    assert cache.match_prefix([3, 3]).num_tokens == 2 and cache.match_prefix([1, 1]).num_tokens == 2
    # [3,3] was touched before [1,1] just now -> goes next
    assert cache.evict(2) == 2
    assert cache.match_prefix([3, 3]).num_tokens == 0 and cache.match_prefix([1, 1]).num_tokens == 2
    cache.check_invariants()


def test_evict_partial_leaf_trims_tail_and_parent_becomes_leaf():
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3, 4, 5, 6])
    put(cache, alloc, [1, 2, 3, 7])  # splits: [1,2,3] -> {[4,5,6], [7]}
    cache.match_prefix([1, 2, 3, 7])  # make [4,5,6] the LRU leaf
    assert cache.evict(2) == 2  # trims [4,5,6] to [4]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).num_tokens == 4
    cache.check_invariants()
    assert cache.evict(3) == 3  # [4], then [7], then 1 of the parent's 3
    assert cache.total_cached_tokens == 2 and cache.match_prefix([1, 2, 3]).num_tokens == 2
    cache.check_invariants()
    assert cache.reset() == 2 and alloc.num_free == alloc.num_blocks
    cache.check_invariants()


def test_disabled_cache():
    alloc, cache = make(enabled=False)
    blocks = alloc.allocate(3)
    assert cache.insert([1, 2, 3], blocks) == 0
    assert alloc.num_free == alloc.num_blocks
    assert cache.match_prefix([1, 2, 3]).num_tokens == 0
    own = alloc.allocate(2)
    node, n = cache.cache_sequence([1, 2], own)
    assert node is cache.root and n == 0 and alloc.num_free == alloc.num_blocks - 2
    cache.check_invariants()


def test_cache_sequence_fork_flow():
    alloc, cache = make(num_blocks=32, page=4)
    parent_tokens = list(range(10))  # 2 full pages + a partial page of 2
    parent_blocks = alloc.allocate(3)
    node, n = res = cache.cache_sequence(parent_tokens, parent_blocks[:2])
    assert n == 8 and res.blocks == parent_blocks[:2]
    assert cache.protected_blocks == 2 and cache.evictable_blocks == 0
    # two children share the prefix and copy only the partial page
    kids = []
    for _ in range(2):
        m = cache.match_prefix(parent_tokens)
        cache.lock(m.node)
        assert m.blocks == parent_blocks[:2] and m.num_tokens == 8
        kids.append((m, alloc.allocate(1)))
    assert cache.evict(10) == 0  # everything locked
    # parent finishes: its full pages are the tree's, insert frees nothing
    free_before = alloc.num_free
    assert cache.insert(parent_tokens, res.blocks) == 8
    assert alloc.num_free == free_before
    cache.unlock(node)
    alloc.free(parent_blocks[2:])
    for m, partial in kids:
        cache.unlock(m.node)
        alloc.free(partial)
    cache.check_invariants()
    assert cache.evict(10) == 2 and alloc.num_free == alloc.num_blocks


def test_cache_sequence_with_already_cached_pages_switches_blocks():
    alloc, cache = make(num_blocks=16, page=2)
    tree = put(cache, alloc, [1, 2, 3, 4])
    mine = alloc.allocate(3)
    node, n = res = cache.cache_sequence([1, 2, 3, 4, 5, 6], mine)
    assert n == 6
    # pages [1,2] and [3,4] were cached: the sequence's duplicates were freed
    assert res.blocks == tree + mine[2:]
    assert cache.path_blocks(node) == res.blocks
    assert alloc.num_free == alloc.num_blocks - 3
    cache.unlock(node)
    cache.check_invariants()


def test_cache_sequence_ending_inside_a_node_splits():
    alloc, cache = make()
    put(cache, alloc, [1, 2, 3, 4, 5])
    mine = alloc.allocate(3)
    node, n = cache.cache_sequence([1, 2, 3], mine)
    assert n == 3 and node.key == [1, 2, 3] and cache.num_nodes == 2
    assert cache.protected_blocks == 3 and cache.evictable_blocks == 2
    assert cache.evict(10) == 2
    cache.unlock(node)
    cache.check_invariants()
