"""A free-list allocator over the fixed pool of KV-cache blocks.

Ownership is exclusive: a block belongs either to one running sequence or to one radix-cache
node, never to both, so no reference counts are needed here. Sharing between sequences goes
through the radix cache (a sequence locks the cached nodes it reads).
"""

from __future__ import annotations

from collections import deque

from deepinfer.errors import OutOfBlocksError


class BlockAllocator:
    """Blocks first .. first + num_blocks - 1 (first > 0: one rank's share of a partitioned id space,
    kv_pools.py)."""

    def __init__(self, num_blocks: int, block_size: int, first: int = 0):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.first = first
        self._free: deque[int] = deque(range(first, first + num_blocks))
        self._used = [False] * num_blocks

    def owns(self, block: int) -> bool:
        return self.first <= block < self.first + self.num_blocks

    def is_used(self, block: int) -> bool:
        return self._used[block - self.first]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks; raises OutOfBlocksError (and takes none) if fewer are free."""
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._used[b - self.first] = True
        return out

    def free(self, blocks: list[int]) -> None:
        """Return blocks to the pool. Freeing a block twice is a bug and raises."""
        for b in blocks:
            if not self._used[b - self.first]:
                raise RuntimeError(f"KV block {b} freed twice")
            self._used[b - self.first] = False
            self._free.append(b)
