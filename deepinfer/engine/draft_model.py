"""Self-drafting (speculative="draft"): draft tokens from the target's own first N layers, its final
norm and its head (an early exit), so any model drafts for itself offline, with no second checkpoint.

The draft needs no KV cache of its own. Its layers are the target's first N, so for every verified
position the target's cache already holds their K/V; for the draft positions it writes K/V into the
slots the scheduler allocated for the drafts, and the verify pass that follows rewrites all of those
(a forward writes every query token's K/V before attending), so nothing it wrote is ever read by the
target. Draft lengths are chosen before the drafts exist (speculation.py: per-position acceptance
learned online, the forward-cost model plus the draft passes' own cost); the tokens are drawn after
the step is scheduled, one batched pass per draft position, greedily.

`CheckpointDrafter` (speculative="draft", draft_model=PATH) drafts with a second, smaller checkpoint
that shares the target's tokenizer. It has a KV cache of its own, paged by the *target's* block ids
(its pool has as many blocks), so preemption, the radix cache and fork need no bookkeeping of their
own: per sequence it remembers which tokens its cache holds and under which block ids, and before
drafting it brings that cache up to the sequence's newest token in the same batched pass that draws
the first draft (a new or preempted sequence, or one whose blocks changed, is caught up from the
start: the draft model is small, and a stale entry would only make worse drafts, never wrong
outputs, since the target verifies every draft).

Its confidence is its own probability, calibrated online: the budget admits slots by per-position
acceptance (the drafts do not exist yet when it plans), then each drawn draft's probability under
the draft model picks a bucket whose acceptance rate is learned from verification (prior: the
probability itself), and a sequence's run is cut at the first draft whose calibrated survival falls
below what the budget's last admitted slot needed (SpecDec++'s "stop when rejection is likely").
"""

from __future__ import annotations

import time
import weakref

import torch

from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.sequence import Sequence

DRAFT_KEY = ("draft",)
BUCKETS = 10  # draft-model probability buckets whose acceptance is learned (CheckpointDrafter)
PRIOR_WEIGHT = 4.0  # trials the prior (the bucket's own probability) counts for
MIN_TRIALS = 8  # verified drafts a bucket needs before its rate can cut a run
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
    def fill(self, seqs: list[Sequence], min_survival: float = 0.0) -> None:
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


class CheckpointDrafter:
    """Drafts from a separate draft model's runner (its own weights and paged KV cache)."""

    index = None

    def __init__(self, runner, target_vocab: int, max_draft: int, block_size: int):
        self.runner = runner  # the draft model's ModelRunner, num_blocks equal to the target's
        self.target_vocab = target_vocab  # draws are limited to ids the target knows
        self.max_draft = max_draft
        self.block_size = block_size
        self.seconds = 0.0  # time spent in draft passes (catch-up included)
        self.caught_up_tokens = 0  # tokens fed to catch the draft cache up (stats, tests)
        # sequence -> (its tokens held then, the drafts fed after them, the block ids, preemptions then)
        self._held: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # calibration of the draft model's own probability: per bucket, drafts verified and accepted
        self.trials = [0.0] * BUCKETS
        self.hits = [0.0] * BUCKETS
        self._buckets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # seq -> its drafts' buckets
        self.cut_drafts = 0  # drafts cut after drawing because their calibrated survival was too low

    def calibrated(self, bucket: int) -> float | None:
        """P(accepted | the draft model gave its token a probability in this bucket), or None until
        the bucket has MIN_TRIALS verified drafts (until then the budget's own estimate stands: a
        prior alone would cut runs that are never verified, so the bucket would never learn)."""
        if self.trials[bucket] < MIN_TRIALS:
            return None
        prior = (bucket + 0.5) / BUCKETS
        return (self.hits[bucket] + prior * PRIOR_WEIGHT) / (self.trials[bucket] + PRIOR_WEIGHT)

    def observe_drafts(self, seq: Sequence, verified: int, accepted: int) -> None:
        """The first `accepted` of the `verified` drafts passed: learn their buckets' rates."""
        buckets = self._buckets.pop(seq, None)
        if not buckets:
            return
        for j in range(min(accepted + 1, verified, len(buckets))):  # draft j was tried if all before passed
            self.trials[buckets[j]] += 1
            self.hits[buckets[j]] += j < accepted

    def propose_keyed(self, tokens: list[int], k: int) -> tuple[list[int], tuple]:
        return [PENDING] * min(k, self.max_draft), DRAFT_KEY

    def relative_cost(self, target_runner, sizes=(1, 4, 16)) -> float:
        """A draft pass's cost as a share of a target forward at the same batch, measured now."""
        full = dict(target_runner.measure_forward_cost(list(sizes)))
        part = dict(self.runner.measure_forward_cost(list(sizes)))
        return sum(part[t] / full[t] for t in sizes) / len(sizes)

    def _valid(self, seq: Sequence) -> int:
        """How many of the sequence's leading tokens the draft cache holds, as they are now. The
        first `base` were the sequence's own tokens when it last drafted (a sequence's tokens never
        change), so only the drafts fed after them are compared: per step O(drafts), not O(length)."""
        held = self._held.get(seq)
        if held is None:
            return 0
        base, fed, table, preemptions = held
        if preemptions != seq.num_preemptions:
            return 0
        limit = seq.num_computed_tokens
        n = min(base, limit)
        for tok in fed:
            if n >= limit or n >= seq.num_tokens or seq.token_at(n) != tok:
                break
            n += 1
        blocks = -(-n // self.block_size)
        if seq.block_table[:blocks] != table[:blocks]:
            return 0
        return n

    @torch.inference_mode()
    def fill(self, seqs: list[Sequence], min_survival: float = 0.0) -> None:
        """Draw the scheduled drafts (see SelfDrafter.fill). Pass 0 feeds each sequence's tokens from
        the first one its draft cache lacks through its newest; pass i > 0 feeds draft i - 1. A run
        ends early (its draft list shortened) at the first draft whose calibrated survival is below
        min_survival."""
        seqs = [s for s in seqs if s.draft_token_ids]
        if not seqs:
            return
        t0 = time.perf_counter()
        runs = []
        for s in seqs:
            start = self._valid(s)
            runs.append((s, start, [s.token_at(i) for i in range(start, s.num_computed_tokens + 1)]))
        # single-token runs first (ForwardBatch lays decodes out before multi-token runs)
        runs.sort(key=lambda r: len(r[2]) > 1 or r[1] == 0)
        seqs = [r[0] for r in runs]
        self.caught_up_tokens += sum(len(t) - 1 for _, _, t in runs)
        rows, at = [], 0
        for _, _, toks in runs:
            at += len(toks)
            rows.append(at - 1)
        batch = ForwardBatch.build([t for _, _, t in runs], [st for _, st, _ in runs],
                                   [s.block_table for s in seqs], rows, self.block_size)
        fed = {s: 0 for s in seqs}  # drafts fed (their KV written) per sequence
        survival = {s: 1.0 for s in seqs}
        buckets: dict[Sequence, list[int]] = {s: [] for s in seqs}
        live = seqs
        for i in range(max(len(s.draft_token_ids) for s in seqs)):
            if i:
                live = [s for s in live if len(s.draft_token_ids) > i]
                if not live:
                    break
                batch = ForwardBatch.build(
                    [[s.draft_token_ids[i - 1]] for s in live], [s.num_computed_tokens + i for s in live],
                    [s.block_table for s in live], list(range(len(live))), self.block_size,
                )
                for s in live:
                    fed[s] += 1
            for s, (tok, b) in zip(live, self._draw(batch)):
                c = self.calibrated(b)
                survival[s] *= 1.0 if c is None else c
                if survival[s] < min_survival:  # not worth verifying: the run ends before this draft
                    self.cut_drafts += len(s.draft_token_ids) - i
                    del s.draft_token_ids[i:]
                    continue
                s.draft_token_ids[i] = tok
                buckets[s].append(b)
        for s in seqs:
            # the cache holds the sequence's tokens and the drafts fed (all but the last drawn one)
            self._held[s] = (s.num_computed_tokens + 1, s.draft_token_ids[: fed[s]], list(s.block_table),
                             s.num_preemptions)
            self._buckets[s] = buckets[s]
        self.seconds += time.perf_counter() - t0

    def _draw(self, batch: ForwardBatch) -> list[tuple[int, int]]:
        """(greedy token, bucket of its probability under the draft model) per logit row."""
        logits = self.runner.forward(self.runner.prepare(batch))[:, : self.target_vocab]
        p, tok = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        b = (p * BUCKETS).long().clamp(max=BUCKETS - 1)
        return list(zip(tok.tolist(), b.tolist()))


def check_same_tokenizer(target, draft, draft_source: str) -> None:
    """A draft model must spell every token id as the target does (its drafts are target ids)."""
    from deepinfer.errors import InvalidRequestError

    a, b = target.hf.get_vocab(with_added_tokens=True), draft.hf.get_vocab(with_added_tokens=True)
    if a == b:
        return
    diff = sorted((set(a.items()) ^ set(b.items())), key=lambda kv: kv[1])
    tok, i = diff[0]
    raise InvalidRequestError(
        f"draft_model {draft_source}: its tokenizer differs from the target's ({len(a)} vs {len(b)} tokens; "
        f"first difference at id {i}, {tok!r}); a draft model must share the target's tokenizer")
