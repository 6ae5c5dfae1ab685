"""Radix prefix cache: a tree over token ids whose nodes own KV-cache blocks.

Ownership (exclusive, SGLang-style): every KV block belongs either to one running sequence or to
exactly one tree node; the allocator keeps no reference counts. With page size P =
``allocator.block_size`` the tree stores whole pages only: a node's key is a token list whose
length is a multiple of P, and its ``blocks`` hold one block per page, in order. P = 1 gives
exact token-level sharing.

Request life cycle (what the scheduler does):

1. ``m = cache.match_prefix(prompt, max_tokens=len(prompt) - 1)`` then ``cache.lock(m.node)``.
   ``m.blocks`` are the tree's own blocks (same ids); the request reads them but does not own
   them. Leaving at least one prompt token uncached lets the model compute the first logits.
2. The request allocates its own blocks for the rest of its tokens and computes them.
3. On finish: ``cache.insert(all_tokens, m.blocks + own_full_blocks)`` then
   ``cache.unlock(m.node)``; the request frees its trailing partial block itself.
   ``insert`` walks the tree page by page. For a page the tree already holds, the caller's block
   is either the very block the tree holds for that page (the request got it from
   ``match_prefix``: it stays in the tree, nothing is freed) or a different block holding the
   same tokens (a duplicate computed by the request: the tree frees it). Pages the tree lacks
   are taken over by the tree. Afterwards the caller owns none of the blocks it handed in.

Fork (``cache_sequence``): to share a live sequence's prefix, the parent's full pages go into the
tree and are locked in one step; the parent keeps using the tree's blocks for those pages (the
returned ``blocks``; they equal the parent's own blocks unless some pages were already cached,
in which case the parent's duplicates were freed and it must switch to the tree's ids). Each
child then does ``match_prefix`` + ``lock`` and copies only the partial last page into a block
of its own (copy-on-write is the caller's job). Every lock is later released with ``unlock``.

``peek_prefix_len`` answers "how much would match" without splitting or touching LRU times (for
admission decisions that may not go ahead).

Eviction frees blocks of unlocked leaves, least recently used first; a leaf larger than what is
still needed is trimmed from its tail, so ``evict(n)`` never frees more than n blocks. Locked
nodes (and their ancestors, which carry the lock too) are never evicted.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from deepinfer.engine.block_allocator import BlockAllocator
from deepinfer.errors import DeepInferError


class RadixCacheError(DeepInferError, ValueError):
    """The radix cache was misused (bad block list, unlocking an unlocked node, ...)."""


class RadixNode:
    """One tree node: ``key`` tokens (a multiple of the page size) and one KV block per page."""

    __slots__ = ("id", "key", "blocks", "parent", "children", "lock_ref", "last_access")

    def __init__(self, node_id: int, key: list[int], blocks: list[int], parent: RadixNode | None):
        self.id = node_id
        self.key = key
        self.blocks = blocks
        self.parent = parent
        # child map key: the child's first page (an int for page size 1, else a tuple).
        self.children: dict = {}
        self.lock_ref = 0
        self.last_access = 0

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, tokens={len(self.key)}, blocks={self.blocks}, lock_ref={self.lock_ref})"


@dataclass
class PrefixMatch:
    """Result of ``match_prefix``: the tree's blocks covering the first ``num_tokens`` tokens.

    ``node`` is the deepest matched node (the root when nothing matched); pass it to
    ``lock``/``unlock``.
    """

    blocks: list[int]
    num_tokens: int
    node: RadixNode


class CachedSequence(tuple):
    """``(node, num_tokens)`` as returned by ``cache_sequence``, plus ``.blocks``: the tree's
    blocks for those tokens, which the sequence must use from now on."""

    def __new__(cls, node: RadixNode, num_tokens: int, blocks: list[int]):
        obj = super().__new__(cls, (node, num_tokens))
        obj.blocks = blocks
        return obj

    @property
    def node(self) -> RadixNode:
        return self[0]

    @property
    def num_tokens(self) -> int:
        return self[1]


class RadixCache:
    """Prefix cache over token ids; nodes own KV blocks from ``allocator``.

    With ``enabled=False`` nothing is ever cached: ``match_prefix`` matches nothing and
    ``insert`` frees the blocks it is given.
    """

    def __init__(self, allocator: BlockAllocator, enabled: bool = True):
        self.allocator = allocator
        self.page_size = allocator.block_size
        self.enabled = enabled
        self._next_id = 0
        self._clock = 0
        self.root = self._new_node([], [], None)
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_blocks = 0
        self.protected_blocks = 0
        self.total_cached_tokens = 0
        self.num_nodes = 0  # excluding the root
        self._owned: set[int] = set()  # every block id the tree owns

    # ----------------------------------------------------------------- helpers
    def _new_node(self, key: list[int], blocks: list[int], parent: RadixNode | None) -> RadixNode:
        node = RadixNode(self._next_id, key, blocks, parent)
        self._next_id += 1
        return node

    def _tick(self) -> int:
        # a logical clock, not wall time: deterministic LRU order and no ties between accesses
        self._clock += 1
        return self._clock

    def _page_key(self, key: Sequence[int], start: int = 0):
        if self.page_size == 1:
            return key[start]
        return tuple(key[start : start + self.page_size])

    def _common_pages(self, node_key: list[int], key: Sequence[int], start: int) -> int:
        """How many whole pages of node_key equal key[start:]."""
        p = self.page_size
        n = min(len(node_key), len(key) - start)
        i = 0
        while i < n and node_key[i] == key[start + i]:
            i += 1
        return i // p

    def _split(self, node: RadixNode, pages: int) -> RadixNode:
        """Split ``node`` after ``pages`` pages; returns the new upper node (same lock state)."""
        t = pages * self.page_size
        parent = node.parent
        upper = self._new_node(node.key[:t], node.blocks[:pages], parent)
        upper.lock_ref = node.lock_ref  # every lock through node passes through upper too
        upper.last_access = node.last_access
        node.key = node.key[t:]
        node.blocks = node.blocks[pages:]
        node.parent = upper
        upper.children[self._page_key(node.key)] = node
        parent.children[self._page_key(upper.key)] = upper
        self.num_nodes += 1
        return upper

    def _check_blocks(self, token_ids: Sequence[int], blocks: Sequence[int]) -> None:
        if len(blocks) * self.page_size > len(token_ids):
            raise RadixCacheError(
                f"{len(blocks)} blocks of {self.page_size} tokens cover more than the {len(token_ids)} tokens given"
            )
        if len(set(blocks)) != len(blocks):
            raise RadixCacheError(f"block list has repeated ids: {list(blocks)}")
        a = self.allocator
        for b in blocks:
            if not a.owns(b):
                raise RadixCacheError(f"block id {b} out of range [{a.first}, {a.first + a.num_blocks})")
            if not a.is_used(b):
                raise RadixCacheError(f"block {b} handed to the cache is not allocated")

    # ----------------------------------------------------------------- matching
    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of ``token_ids`` (whole pages, at most ``max_tokens`` tokens).

        Splits a node when the match ends inside it, so the returned node covers exactly the
        match. Marks the matched path as recently used. Does not lock anything.
        """
        if not self.enabled:
            return PrefixMatch([], 0, self.root)
        p = self.page_size
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max(0, max_tokens))
        limit -= limit % p
        node, pos = self.root, 0
        blocks: list[int] = []
        for node, start in self._walk(token_ids[:limit], self._tick()):
            blocks.extend(node.blocks)
            pos = start + len(node.key)
        return PrefixMatch(blocks, pos, node)

    def _walk(self, key: Sequence[int], now: int):
        """Descend from the root along the whole pages of ``key``: yields ``(node, start)`` for each
        matched node in order (``start``: its first token's position), splitting a node where the
        match ends inside it and marking each one used at ``now``."""
        node, pos = self.root, 0
        while pos < len(key):
            child = node.children.get(self._page_key(key, pos))
            if child is None:
                return
            pages = self._common_pages(child.key, key, pos)
            if pages * self.page_size < len(child.key):
                child = self._split(child, pages)
            child.last_access = now
            yield child, pos
            pos += len(child.key)
            node = child

    def peek_prefix_len(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """Length of the cached prefix ``match_prefix`` would return, read-only: no split, no
        LRU update (for admission decisions that may not go ahead)."""
        if not self.enabled:
            return 0
        p = self.page_size
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max(0, max_tokens))
        limit -= limit % p
        key = token_ids[:limit]
        node, pos = self.root, 0
        while pos < limit:
            child = node.children.get(self._page_key(key, pos))
            if child is None:
                break
            pages = self._common_pages(child.key, key, pos)
            pos += pages * p
            if pages * p < len(child.key):
                break
            node = child
        return pos

    # ----------------------------------------------------------------- locking
    def lock(self, node: RadixNode) -> None:
        """Protect ``node`` and its ancestors from eviction (counted; pair with ``unlock``).

        Lock right after ``match_prefix``: a node evicted in between cannot be locked.
        """
        if node is not self.root and node.parent is None:
            raise RadixCacheError(f"lock of an evicted node: {node!r}")
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_blocks -= len(node.blocks)
                self.protected_blocks += len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Release one ``lock`` of ``node``."""
        if node is not self.root and node.lock_ref <= 0:
            raise RadixCacheError(f"unlock of a node that is not locked: {node!r}")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_blocks += len(node.blocks)
                self.protected_blocks -= len(node.blocks)
            node = node.parent

    # ----------------------------------------------------------------- insertion
    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> int:
        """Hand ``blocks`` (covering ``token_ids[:len(blocks) * P]``) over to the tree.

        Pages already cached keep the tree's block; a caller block for such a page is freed
        unless it *is* the tree's block (it came from ``match_prefix``). Pages not cached
        become owned by the tree. Returns the number of tokens that were already cached.
        """
        self._check_blocks(token_ids, blocks)
        if not self.enabled:
            self.allocator.free(list(blocks))
            return 0
        _, cached, _ = self._insert(token_ids, list(blocks))
        return cached

    def _insert(self, token_ids: Sequence[int], blocks: list[int]) -> tuple[RadixNode, int, list[int]]:
        """Insert; returns (node ending exactly at the inserted length, tokens already cached,
        the tree's blocks for the inserted pages)."""
        p = self.page_size
        total = len(blocks) * p
        key = token_ids[:total]
        now = self._tick()
        node, pos = self.root, 0
        tree_blocks: list[int] = []
        duplicates: list[int] = []
        for node, start in self._walk(key, now):
            page0 = start // p
            for i, tb in enumerate(node.blocks):
                cb = blocks[page0 + i]
                if cb != tb:
                    if cb in self._owned:
                        raise RadixCacheError(
                            f"block {cb} handed to insert for page {page0 + i} is owned by the tree for another page"
                        )
                    duplicates.append(cb)
            tree_blocks.extend(node.blocks)
            pos = start + len(node.key)
        cached = pos
        new_blocks = blocks[pos // p :]
        for b in new_blocks:
            if b in self._owned:
                raise RadixCacheError(f"block {b} handed to insert for a new page is already owned by the tree")
        if duplicates:
            self.allocator.free(duplicates)
        if new_blocks:
            leaf = self._new_node(list(key[pos:]), list(new_blocks), node)
            leaf.last_access = now
            node.children[self._page_key(leaf.key)] = leaf
            self.num_nodes += 1
            self.evictable_blocks += len(new_blocks)
            self.total_cached_tokens += len(leaf.key)
            self._owned.update(new_blocks)
            tree_blocks.extend(new_blocks)
            node = leaf
        return node, cached, tree_blocks

    def cache_sequence(self, token_ids: Sequence[int], blocks: Sequence[int]) -> CachedSequence:
        """Insert a live sequence's full pages and lock them (for fork).

        ``blocks`` cover ``token_ids[:len(blocks) * P]``. Returns ``(node, num_tokens)`` (with
        ``.blocks``, the tree's blocks for those tokens, which the sequence uses from now on);
        the caller later calls ``unlock(node)``. Disabled cache: returns ``(root, 0)`` with no
        blocks and takes nothing.
        """
        self._check_blocks(token_ids, blocks)
        if not self.enabled or not blocks:
            return CachedSequence(self.root, 0, [])
        node, _, tree_blocks = self._insert(token_ids, list(blocks))
        self.lock(node)
        return CachedSequence(node, len(blocks) * self.page_size, tree_blocks)

    def path_blocks(self, node: RadixNode) -> list[int]:
        """The blocks on the path root..node, in token order."""
        parts = []
        while node is not self.root:
            parts.append(node.blocks)
            node = node.parent
        return [b for part in reversed(parts) for b in part]

    # ----------------------------------------------------------------- eviction
    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks from unlocked leaves, least recently used first.

        Returns how many blocks were freed (less than asked only when nothing unlocked is left).
        """
        if num_blocks <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            take = min(len(leaf.blocks), num_blocks - freed)
            gone = leaf.blocks[len(leaf.blocks) - take :]
            self.allocator.free(gone)
            self._owned.difference_update(gone)
            freed += take
            self.evictable_blocks -= take
            self.total_cached_tokens -= take * self.page_size
            if take < len(leaf.blocks):
                # trim the tail: the remaining prefix stays valid and cached
                leaf.blocks = leaf.blocks[: len(leaf.blocks) - take]
                leaf.key = leaf.key[: len(leaf.blocks) * self.page_size]
                break
            parent = leaf.parent
            del parent.children[self._page_key(leaf.key)]
            leaf.parent, leaf.blocks = None, []  # detached: lock() refuses it
            self.num_nodes -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out

    def reset(self) -> int:
        """Free every unlocked node's blocks; returns how many were freed."""
        return self.evict(self.evictable_blocks)

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Raise AssertionError if the tree's structure or counters are inconsistent (tests)."""
        p = self.page_size
        seen: set[int] = set()
        evictable = protected = tokens = nodes = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            child_locks = 0
            for k, c in n.children.items():
                assert c.parent is n, f"{c!r} has a wrong parent"
                assert len(c.key) > 0 and len(c.key) % p == 0, f"{c!r} key length not a positive multiple of {p}"
                assert len(c.blocks) * p == len(c.key), f"{c!r} has {len(c.blocks)} blocks for {len(c.key)} tokens"
                assert k == self._page_key(c.key), f"{c!r} stored under the wrong first page {k!r}"
                assert c.lock_ref >= 0
                child_locks += c.lock_ref
                stack.append(c)
            if n is self.root:
                continue
            assert n.lock_ref >= child_locks, f"{n!r} has fewer locks than its children"
            nodes += 1
            tokens += len(n.key)
            for b in n.blocks:
                assert b not in seen, f"block {b} owned by two nodes"
                assert self.allocator.is_used(b), f"block {b} is in the tree but free in the allocator"
                seen.add(b)
            if n.lock_ref > 0:
                protected += len(n.blocks)
            else:
                evictable += len(n.blocks)
        assert seen == self._owned, "owned-block set out of sync"
        assert nodes == self.num_nodes, f"num_nodes {self.num_nodes} != {nodes}"
        assert tokens == self.total_cached_tokens, f"total_cached_tokens {self.total_cached_tokens} != {tokens}"
        assert evictable == self.evictable_blocks, f"evictable_blocks {self.evictable_blocks} != {evictable}"
        assert protected == self.protected_blocks, f"protected_blocks {self.protected_blocks} != {protected}"
