"""Decode steps replayed from CUDA graphs, one per padded batch-size bucket (Engine(cuda_graphs=True)).

A decode-only step (every sequence one query token, one logits row each) is padded up to the next
bucket (1, 2, 4, 8, 16, 32, then multiples of 32 up to max_num_seqs) and replayed from the graph
captured for that bucket: one launch for the whole forward instead of hundreds of small kernels
whose launch cost is what bounds a small model on a large GPU. Prefill and mixed steps run eagerly.

Static shapes: the graph reads fixed buffers (ids, positions, KV slots, block tables padded to
the longest context's blocks, context lengths), which `replay` fills before launching. That needs
the paged decode kernel (block tables + lengths); the gather-based torch decode has per-step shapes
and is never captured. Padding rows decode token 0 at position 0 against one scratch KV block that
the allocator never hands out (the runner allocates it past the pool), so they write nothing any
sequence reads.
"""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.engine.attention import ForwardContext


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: powers of two to 32, then steps of 32."""
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_num_seqs]
    sizes += list(range(32, max_num_seqs + 32, 32))
    return sorted({min(b, max_num_seqs) for b in sizes})


def bucket_for(n: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding n rows, or None when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    return None


class DecodeGraphs:
    """Captures and replays decode forwards. run_model(ids, positions, ctx) -> logits [B, V]."""

    def __init__(self, run_model: Callable, make_ctx: Callable, device: torch.device, max_num_seqs: int,
                 max_blocks: int, block_size: int, scratch_block: int):
        self.run_model = run_model
        self.make_ctx = make_ctx  # (slot_mapping, num_decode, block_tables, context_lens) -> ForwardContext
        self.device = device
        self.buckets = bucket_sizes(max_num_seqs)
        self.block_size = block_size
        self.scratch_block = scratch_block
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0

    def _ctx(self, b: int) -> ForwardContext:
        return self.make_ctx(self.slots[:b], b, self.block_tables[:b], self.context_lens[:b])

    def _reset_padding(self, start: int) -> None:
        self.ids[start:].zero_()
        self.positions[start:].zero_()
        self.slots[start:] = self.scratch_block * self.block_size
        self.block_tables[start:] = self.scratch_block
        self.context_lens[start:] = 1

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool)."""
        self._reset_padding(0)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b in reversed(self.buckets):  # warm-up: first-use allocations and kernel builds
                self.run_model(self.ids[:b], self.positions[:b], self._ctx(b))
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                self.outputs[b] = self.run_model(self.ids[:b], self.positions[:b], self._ctx(b))
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize(self.device)

    def fits(self, num_seqs: int, max_blocks: int) -> bool:
        return bucket_for(num_seqs, self.buckets) is not None and max_blocks <= self.block_tables.shape[1]

    @torch.inference_mode()
    def replay(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] of a decode step of n rows (tensors on the device; block_tables [n, <= max])."""
        n = ids.shape[0]
        b = bucket_for(n, self.buckets)
        self.ids[:n].copy_(ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(slots, non_blocking=True)
        w = block_tables.shape[1]
        self.block_tables[:n, :w].copy_(block_tables, non_blocking=True)
        self.block_tables[:n, w:] = self.scratch_block  # never read: past each row's context
        self.context_lens[:n].copy_(context_lens, non_blocking=True)
        if n < b:
            self._reset_padding(n)
        self.graphs[b].replay()
        self.replays += 1
        # a copy: the sampler masks the logits in place, and the next replay rewrites the buffer
        return self.outputs[b][:n].clone()
