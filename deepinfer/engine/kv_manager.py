"""Block tables: which KV blocks hold which sequence's tokens, with radix prefix reuse.

A sequence's block_table starts with the blocks it matched in the radix cache (owned by the tree,
locked while the sequence runs) followed by blocks it owns. When it finishes or is preempted, its
full blocks are handed to the tree (so the next request with the same prefix reuses them) and its
partial last block is freed.
"""

from __future__ import annotations

from deepinfer.engine.block_allocator import BlockAllocator
from deepinfer.engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, allocator: BlockAllocator, radix=None):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.radix = radix  # RadixCache or None (prefix caching off)

    @property
    def caching(self) -> bool:
        """Prefix caching is on."""
        return self.radix is not None

    # ---- capacity -----------------------------------------------------------------------------
    def num_available_blocks(self) -> int:
        """Free blocks plus blocks the radix cache could evict."""
        extra = self.radix.evictable_blocks if self.radix is not None else 0
        return self.allocator.num_free + extra

    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def max_seq_blocks(self) -> int:
        """The most blocks one sequence can hold."""
        return self.allocator.num_blocks

    def fits(self, demands: list[tuple[Sequence, int]]) -> bool:
        """Whether every (sequence, tokens it must cover) could get its blocks at once."""
        return sum(self.blocks_needed(s, n) for s, n in demands) <= self.num_available_blocks()

    def same_pool(self, a: Sequence, b: Sequence) -> bool:
        """Whether freeing a's blocks can make room for b (one pool: always)."""
        return True

    def _take(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        short = n - self.allocator.num_free
        if short > 0 and self.radix is not None:
            self.radix.evict(short)
        if not self.allocator.can_allocate(n):
            return None
        return self.allocator.allocate(n)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        need = -(-num_tokens // self.block_size)
        return max(0, need - len(seq.block_table))

    def cached_prefix_len(self, tokens: list[int]) -> int:
        """How many leading tokens the radix cache holds (read-only: no split, no LRU touch)."""
        if self.radix is None:
            return 0
        return self.radix.peek_prefix_len(tokens)

    # ---- admission ----------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached prefix to a fresh sequence; returns the tokens matched."""
        if self.radix is None or seq.block_table:
            return 0
        tokens = seq.all_token_ids
        # Leave at least one token to compute (its logits are needed), and recompute from where
        # prompt logprobs are wanted (cached positions have no logits).
        cap = len(tokens) - 1
        if seq.params.prompt_logprobs is not None:
            cap = min(cap, max(0, seq.params.prompt_logprobs_start - 1))
        m = self.radix.match_prefix(tokens, max_tokens=cap)
        if m.num_tokens == 0:
            return 0
        self.radix.lock(m.node)
        seq.prefix_node = m.node
        seq.block_table = list(m.blocks)
        seq.num_tree_blocks = len(m.blocks)
        seq.num_computed_tokens = m.num_tokens
        return m.num_tokens

    def unmatch(self, seq: Sequence) -> None:
        """Undo match_prefix for a sequence that could not be admitted after all."""
        if seq.prefix_node is not None:
            self.radix.unlock(seq.prefix_node)
        seq.prefix_node = None
        seq.block_table = []
        seq.num_tree_blocks = 0
        seq.num_computed_tokens = 0

    def allocate_for(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the block table cover the first num_tokens tokens; False (nothing taken) if out of blocks."""
        need = self.blocks_needed(seq, num_tokens)
        blocks = self._take(need)
        if blocks is None:
            return False
        seq.block_table.extend(blocks)
        return True

    # ---- pins (a program batch's shared prefix) -----------------------------------------------
    def pin_prefix(self, token_ids: list[int]):
        """Lock the longest cached prefix of token_ids against eviction; a handle for unpin, or None."""
        if self.radix is None:
            return None
        m = self.radix.match_prefix(list(token_ids))
        if m.num_tokens == 0:
            return None
        self.radix.lock(m.node)
        return m.node

    def unpin(self, handle) -> None:
        if handle is not None and self.radix is not None:
            self.radix.unlock(handle)

    def reset_cache(self) -> None:
        """Drop every unlocked cached page."""
        if self.radix is not None:
            self.radix.reset()

    # ---- release ------------------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        """Give back a finished or preempted sequence's blocks, caching its computed full pages."""
        bt = seq.block_table
        own_start = seq.num_tree_blocks
        if self.radix is not None and self.radix.enabled:
            tokens = seq.all_token_ids
            # only verified tokens go to the tree: KV past them (rejected drafts) is not cached
            n_full = min(min(seq.num_computed_tokens, len(tokens)) // self.block_size, len(bt))
            tokens = tokens[: n_full * self.block_size]
            if n_full > 0:
                self.radix.insert(tokens, bt[:n_full])
            leftover = bt[max(n_full, own_start) :]
        else:
            leftover = bt[own_start:]
        if leftover:
            self.allocator.free(leftover)
        if seq.prefix_node is not None:
            self.radix.unlock(seq.prefix_node)
        seq.prefix_node = None
        seq.block_table = []
        seq.num_tree_blocks = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the KV of every token from position num_tokens on (rejected draft tokens): the
        sequence counts only the first num_tokens as computed, and blocks it no longer needs go back
        to the allocator. Pages owned by the radix tree hold verified tokens and are never cut."""
        if num_tokens >= seq.num_computed_tokens:
            return
        if num_tokens < seq.num_tree_blocks * self.block_size:
            raise ValueError(
                f"cannot truncate {seq.request_id} to {num_tokens} tokens: its first "
                f"{seq.num_tree_blocks * self.block_size} are shared through the prefix cache"
            )
        seq.num_computed_tokens = num_tokens
        keep = max(-(-num_tokens // self.block_size), seq.num_tree_blocks)
        extra = seq.block_table[keep:]
        if extra:
            del seq.block_table[keep:]
            self.allocator.free(extra)

    def cache_computed(self, seq: Sequence) -> None:
        """Put a live sequence's computed full pages into the radix cache now (locked by it), so
        requests admitted after its prefill can reuse them before it finishes."""
        if self.radix is None or not self.radix.enabled:
            return
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if n_full <= seq.num_tree_blocks:
            return
        cs = self.radix.cache_sequence(seq.all_token_ids[: n_full * self.block_size], seq.block_table[:n_full])
        seq.block_table[:n_full] = cs.blocks
        old = seq.prefix_node
        seq.prefix_node = cs.node
        seq.num_tree_blocks = n_full
        if old is not None:
            self.radix.unlock(old)

    # ---- fork ---------------------------------------------------------------------------------
    def fork(self, parent: Sequence, children: list[Sequence], copy_tokens) -> bool:
        """Let children share the parent's computed KV: full pages through the radix cache (locked),
        the partially filled last page copied into a block of each child's own (copy on write).

        copy_tokens(src_block, dst_block, n) copies the first n token slots of a block. Returns
        False (and changes nothing) if the blocks for the partial pages cannot be had.
        """
        bs = self.block_size
        nc = parent.num_computed_tokens
        n_full, partial = divmod(nc, bs)
        if self.radix is None or not self.radix.enabled:
            # no tree to share through: every child copies everything
            need = -(-nc // bs)
            taken = self._take(need * len(children))
            if taken is None:
                return False
            for i, child in enumerate(children):
                own = taken[i * need : (i + 1) * need]
                for j, b in enumerate(own):
                    copy_tokens(parent.block_table[j], b, min(bs, nc - j * bs))
                child.block_table = own
                child.num_computed_tokens = nc
            return True
        extra = self._take(len(children) if partial else 0)
        if extra is None:
            return False
        self.cache_computed(parent)
        for i, child in enumerate(children):
            child.block_table = list(parent.block_table[:n_full])
            child.num_tree_blocks = n_full
            if n_full:
                self.radix.lock(parent.prefix_node)
                child.prefix_node = parent.prefix_node
            if partial:
                copy_tokens(parent.block_table[n_full], extra[i], partial)
                child.block_table.append(extra[i])
            child.num_computed_tokens = nc
        return True
