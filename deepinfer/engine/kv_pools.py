"""The engine's KV block bookkeeping: one pool (KVCacheManager), or one pool per data-parallel
attention rank (RankedKV) when the model runs on several ranks that each hold their own sequences'
KV pages (expert parallelism, distributed/dp_split.py).

Ranked ids: rank r's pool holds global block ids r * stride .. r * stride + stride - 2 (stride =
the rank's pool size; its last block, local id stride - 1, is the rank's scratch block, never handed
out), so a block id names its rank and each rank sees local ids (global - r * stride). Every rank
has its own radix cache: a prefix cached on one rank is KV that only that rank holds.

A sequence is given a pool when it is admitted (`match_prefix`) and keeps it until it releases its
blocks (finish or preemption); fork children take their parent's. The choice balances first (a rank
idle while another runs every sequence loses the data parallelism), then reuses the cache: among the
ranks within one live sequence of the least loaded, the longest cached prefix wins, then the fewest
live sequences, the most available blocks, the lowest rank. A prefix shared by a whole batch is so
computed at most once per rank.
"""

from __future__ import annotations

from deepinfer.engine.block_allocator import BlockAllocator
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.sequence import Sequence

BALANCE_SLACK = 1  # live sequences a rank may run over the least loaded one to reuse its cached prefix


def make_kv(num_ranks: int, blocks_per_rank: int, block_size: int, prefix_caching: bool):
    """The KV bookkeeping for a runner with num_ranks pools of blocks_per_rank usable blocks each."""

    def pool(first: int) -> KVCacheManager:
        allocator = BlockAllocator(blocks_per_rank, block_size, first=first)
        radix = None
        if prefix_caching:
            from deepinfer.engine.radix_cache import RadixCache

            radix = RadixCache(allocator)
        return KVCacheManager(allocator, radix)

    if num_ranks == 1:
        return pool(0)
    stride = blocks_per_rank + 1  # + the rank's scratch block
    return RankedKV([pool(r * stride) for r in range(num_ranks)], stride)


class RankedKV:
    """KVCacheManager's interface over one pool per rank; each call goes to the sequence's pool."""

    def __init__(self, pools: list[KVCacheManager], stride: int):
        self.pools = pools
        self.stride = stride
        self.block_size = pools[0].block_size
        self.live = [0] * len(pools)  # sequences holding (or about to hold) blocks, per pool

    @property
    def caching(self) -> bool:
        return self.pools[0].caching

    def _pool(self, seq: Sequence) -> KVCacheManager:
        if seq.kv_pool is None:
            raise RuntimeError(f"{seq.request_id} has no KV pool (it was never admitted)")
        return self.pools[seq.kv_pool]

    def _assign(self, seq: Sequence, r: int) -> None:
        seq.kv_pool = r
        self.live[r] += 1

    def _drop(self, seq: Sequence) -> None:
        if seq.kv_pool is not None:
            self.live[seq.kv_pool] -= 1
            seq.kv_pool = None

    def _choose(self, tokens: list[int]) -> int:
        least = min(self.live)
        best_key, best = None, 0
        for r, pool in enumerate(self.pools):
            if self.live[r] > least + BALANCE_SLACK:
                continue
            key = (pool.cached_prefix_len(tokens), -self.live[r], pool.num_available_blocks(), -r)
            if best_key is None or key > best_key:
                best_key, best = key, r
        return best

    # ---- capacity -------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks() for p in self.pools)

    @property
    def max_seq_blocks(self) -> int:
        return self.pools[0].max_seq_blocks  # a sequence lives in one pool

    def fits(self, demands: list[tuple[Sequence, int]]) -> bool:
        per_pool: dict[int, list] = {}
        for seq, n in demands:
            per_pool.setdefault(seq.kv_pool, []).append((seq, n))
        return all(self.pools[r].fits(d) for r, d in per_pool.items())

    def same_pool(self, a: Sequence, b: Sequence) -> bool:
        return a.kv_pool == b.kv_pool

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return self.pools[0].blocks_needed(seq, num_tokens)

    def cached_prefix_len(self, tokens: list[int]) -> int:
        return max(p.cached_prefix_len(tokens) for p in self.pools)

    # ---- admission ------------------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        if seq.kv_pool is None:
            self._assign(seq, self._choose(seq.all_token_ids))
        return self._pool(seq).match_prefix(seq)

    def unmatch(self, seq: Sequence) -> None:
        if seq.kv_pool is not None:
            self._pool(seq).unmatch(seq)
            self._drop(seq)

    def allocate_for(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.kv_pool is None:
            self._assign(seq, self._choose(seq.all_token_ids))
        return self._pool(seq).allocate_for(seq, num_tokens)

    # ---- release --------------------------------------------------------------------------------
    def release(self, seq: Sequence) -> None:
        if seq.kv_pool is not None:
            self._pool(seq).release(seq)
            self._drop(seq)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        self._pool(seq).truncate(seq, num_tokens)

    def cache_computed(self, seq: Sequence) -> None:
        self._pool(seq).cache_computed(seq)

    def fork(self, parent: Sequence, children: list[Sequence], copy_tokens) -> bool:
        if not self._pool(parent).fork(parent, children, copy_tokens):
            return False
        for child in children:
            self._assign(child, parent.kv_pool)
        return True

    # ---- pins -----------------------------------------------------------------------------------
    def pin_prefix(self, token_ids: list[int]):
        handles = [(r, h) for r, p in enumerate(self.pools) if (h := p.pin_prefix(token_ids)) is not None]
        return handles or None

    def unpin(self, handle) -> None:
        for r, h in handle or ():
            self.pools[r].unpin(h)

    def reset_cache(self) -> None:
        for p in self.pools:
            p.reset_cache()
