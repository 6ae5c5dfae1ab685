"""Self-drafting (speculative="draft"): draft tokens from the target's own first N layers, its final
norm and its head (an early exit), so any model drafts for itself offline, with no second checkpoint.

The draft needs no KV cache of its own. Its layers are the target's first N, so for every verified
position the target's cache already holds their K/V; for the draft positions it writes K/V into the
slots the scheduler allocated for the drafts, and the verify pass that follows rewrites all of those
(a forward writes every query token's K/V before attending), so nothing it wrote is ever read by the
target. Draft lengths are chosen before the drafts exist (speculation.py: per-position acceptance
learned online, the forward-cost model plus the draft passes' own cost); the tokens are drawn after
the step is scheduled, one batched pass per draft position, greedily.
"""

from __future__ import annotations

import time

import torch

from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.sequence import Sequence

DRAFT_KEY = ("draft",)
PENDING = -1  # a draft slot scheduled but not drawn yet (filled before the step is planned)


class SelfDrafter:
    index = None  # no suffix index: drafts come from the model

    def __init__(self, runner, num_layers: int, max_draft: int, block_size: int):
        total = runner.model_config.num_hidden_layers
        if not 1 <= num_layers < total:
            raise ValueError(f"draft_layers must be in [1, {total - 1}] for this {total}-layer model, got {num_layers}")
        self.runner = runner
        self.num_layers = num_layers
        self.max_draft = max_draft
        self.block_size = block_size
        self.seconds = 0.0  # time spent in draft passes

    def propose_keyed(self, tokens: list[int], k: int) -> tuple[list[int], tuple]:
        """k pending draft slots (the budget may keep fewer); drawn by `fill` once scheduled."""
        return [PENDING] * min(k, self.max_draft), DRAFT_KEY

    def relative_cost(self, sizes=(1, 4, 16)) -> float:
        """A draft pass's cost as a share of a full forward at the same batch, measured now."""
        full = dict(self.runner.measure_forward_cost(list(sizes)))
        part = dict(self.runner.measure_forward_cost(list(sizes), num_layers=self.num_layers))
        return sum(part[t] / full[t] for t in sizes) / len(sizes)

    @torch.inference_mode()
    def fill(self, seqs: list[Sequence]) -> None:
        """Draw the scheduled drafts of decoding sequences (each has len(draft_token_ids) slots,
        with KV blocks allocated for them): pass i feeds each sequence's token at position
        num_computed + i and takes the argmax of the early-exit logits as draft i."""
        seqs = [s for s in seqs if s.draft_token_ids]
        if not seqs:
            return
        t0 = time.perf_counter()
        cur = [s.all_token_ids[-1] for s in seqs]  # the newest token: sampled, its KV not computed yet
        for i in range(max(len(s.draft_token_ids) for s in seqs)):
            live = [j for j, s in enumerate(seqs) if len(s.draft_token_ids) > i]
            batch = ForwardBatch.build(
                [[cur[j]] for j in live], [seqs[j].num_computed_tokens + i for j in live],
                [seqs[j].block_table for j in live], list(range(len(live))), self.block_size,
            )
            logits = self.runner.forward(self.runner.prepare(batch), num_layers=self.num_layers)
            drawn = logits.argmax(dim=-1).tolist()
            for j, tok in zip(live, drawn):
                seqs[j].draft_token_ids[i] = tok
                cur[j] = tok
        self.seconds += time.perf_counter() - t0
