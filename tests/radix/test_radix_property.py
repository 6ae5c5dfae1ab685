"""Property test: random request traffic against the radix cache, checked against a simple model.

The model records, for every block, the token prefix it holds the KV of (tokens up to and
including its page), which "sequences" hold which blocks, and which locks are outstanding.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from deepinfer.engine.block_allocator import BlockAllocator
from deepinfer.engine.radix_cache import RadixCache
from deepinfer.errors import OutOfBlocksError

NUM_BLOCKS = 40
# small alphabet and short prompts so prefixes are shared often
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class Seq:
    """A running request: its tokens, the tree blocks it reads, the blocks it owns, its locks."""

    def __init__(self, tokens, shared, own, locks):
        self.tokens = tokens
        self.shared = shared  # tree-owned blocks for the first len(shared) pages
        self.own = own  # blocks this sequence owns, for the following pages (last may be partial)
        self.locks = locks


class RadixMachine(RuleBasedStateMachine):
    page = 1
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(NUM_BLOCKS, self.page)
        self.cache = RadixCache(self.alloc)
        self.block_prefix: dict[int, tuple] = {}  # block -> tokens up to the end of its page
        self.live: list[Seq] = []

    # ---------------------------------------------------------------- helpers
    def _allocate(self, n):
        if not self.alloc.can_allocate(n):
            self.cache.evict(n - self.alloc.num_free)
        try:
            return self.alloc.allocate(n)
        except OutOfBlocksError:
            return None

    def _record(self, tokens, first_page, blocks):
        p = self.page
        for i, b in enumerate(blocks):
            self.block_prefix[b] = tuple(tokens[: (first_page + i + 1) * p])

    def _cached_prefixes(self):
        """Every page-aligned prefix stored in the tree, by walking it."""
        out = set()
        stack = [(self.cache.root, ())]
        while stack:
            node, pre = stack.pop()
            for c in node.children.values():
                full = pre + tuple(c.key)
                for j in range(len(pre) + self.page, len(full) + 1, self.page):
                    out.add(full[:j])
                stack.append((c, full))
        return out

    def _check_match(self, tokens, m, max_tokens=None):
        p = self.page
        limit = len(tokens) if max_tokens is None else max_tokens
        assert m.num_tokens % p == 0 and len(m.blocks) * p == m.num_tokens
        for i, b in enumerate(m.blocks):
            assert self.block_prefix[b] == tuple(tokens[: (i + 1) * p])
        # maximal: the next page is not cached
        nxt = tuple(tokens[: m.num_tokens + p])
        if len(nxt) == m.num_tokens + p and m.num_tokens + p <= limit:
            assert nxt not in self._cached_prefixes()

    # ---------------------------------------------------------------- rules
    @rule(target=seqs, tokens=tokens_st)
    def start(self, tokens):
        p = self.page
        m = self.cache.match_prefix(tokens, max_tokens=len(tokens) - 1)
        self._check_match(tokens, m, len(tokens) - 1)
        self.cache.lock(m.node)
        need = -(-len(tokens) // p) - len(m.blocks)
        own = self._allocate(need)
        if own is None:
            self.cache.unlock(m.node)
            return None
        self._record(tokens, len(m.blocks), own[: len(tokens) // p - len(m.blocks)])
        seq = Seq(list(tokens), list(m.blocks), own, [m.node])
        self.live.append(seq)
        return seq

    @rule(seq=consumes(seqs))
    def finish(self, seq):
        if seq is None:
            return
        p = self.page
        full = len(seq.tokens) // p
        n_own_full = full - len(seq.shared)
        before = self._cached_prefixes()
        cached = self.cache.insert(seq.tokens, seq.shared + seq.own[:n_own_full])
        assert cached >= len(seq.shared) * p
        # `cached` counts exactly the pages that were in the tree already
        expect = 0
        while expect + p <= full * p and tuple(seq.tokens[: expect + p]) in before:
            expect += p
        assert cached == expect
        self.alloc.free(seq.own[n_own_full:])
        for node in seq.locks:
            self.cache.unlock(node)
        self.live.remove(seq)

    @rule(seq=consumes(seqs))
    def abort(self, seq):
        if seq is None:
            return
        self.alloc.free(seq.own)
        for node in seq.locks:
            self.cache.unlock(node)
        self.live.remove(seq)

    @rule(seq=seqs)
    def fork(self, seq):
        """cache_sequence the parent's full pages; it then reads the tree's blocks."""
        if seq is None or seq not in self.live:
            return
        p = self.page
        full = len(seq.tokens) // p
        n_own_full = full - len(seq.shared)
        node, n = res = self.cache.cache_sequence(seq.tokens, seq.shared + seq.own[:n_own_full])
        assert n == full * p and len(res.blocks) == full
        for i, b in enumerate(res.blocks):
            assert self.block_prefix[b] == tuple(seq.tokens[: (i + 1) * p])
        seq.shared = list(res.blocks)
        seq.own = seq.own[n_own_full:]
        seq.locks.append(node)

    @rule(tokens=tokens_st, cap=st.none() | st.integers(0, 14))
    def match(self, tokens, cap):
        nodes = self.cache.num_nodes
        peek = self.cache.peek_prefix_len(tokens, max_tokens=cap)
        assert self.cache.num_nodes == nodes  # peeking never splits
        m = self.cache.match_prefix(tokens, max_tokens=cap)
        assert peek == m.num_tokens
        self._check_match(tokens, m, cap)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        before = self._cached_prefixes()
        evictable = self.cache.evictable_blocks
        free = self.alloc.num_free
        freed = self.cache.evict(n)
        assert freed == min(n, evictable)
        assert self.alloc.num_free == free + freed
        after = self._cached_prefixes()
        assert after <= before and len(before) - len(after) == freed
        for seq in self.live:  # locked pages all survive
            assert tuple(seq.tokens[: len(seq.shared) * self.page]) in after | {()}

    @precondition(lambda self: not self.live)
    @rule()
    def reset(self):
        self.cache.reset()
        assert self.cache.num_nodes == 0 and self.alloc.num_free == NUM_BLOCKS

    # ---------------------------------------------------------------- invariants
    @invariant()
    def no_leak_no_double_ownership(self):
        self.cache.check_invariants()
        tree = [b for n in self._nodes() for b in n.blocks]
        held = [b for s in self.live for b in s.own]
        free = list(self.alloc._free)
        everything = tree + held + free
        assert len(everything) == NUM_BLOCKS and set(everything) == set(range(NUM_BLOCKS))
        # blocks read by live sequences are the tree's, and protected
        protected = {b for n in self._nodes() if n.lock_ref > 0 for b in n.blocks}
        for s in self.live:
            assert set(s.shared) <= protected
        assert self.cache.evictable_blocks == len(tree) - len(protected)

    def _nodes(self):
        out, stack = [], [self.cache.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.cache.root:
                out.append(n)
        return out


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


class RadixPage1(RadixMachine):
    page = 1


class RadixPage3(RadixMachine):
    page = 3


TestRadixPage1 = RadixPage1.TestCase
TestRadixPage1.settings = _settings
TestRadixPage3 = RadixPage3.TestCase
TestRadixPage3.settings = _settings
