"""MTP drafting (speculative="mtp"): the checkpoint's multi-token-prediction layer (DeepSeek-V3's
`num_nextn_predict_layers`, models/mtp.py) proposes the token after next, verified by the target.

MTP row j combines the target's final hidden state at position j with the token at j + 1 and predicts
the token at j + 2; it attends over the MTP layer's own KV cache (one more layer in the runner's paged
cache, addressed by the sequence's block table like any layer). So after every step, once its tokens
are known, the rows whose next token is known are run for each sequence of the step:

    positions start .. min(last query position, num_tokens - 2)

(a prefill chunk: all of them while the prompt continues; a decode or a verify: up to the newest
accepted token). That fills the MTP cache exactly where the target's tokens are final (rejected
drafts never get a row), and the last row, at num_tokens - 2, predicts the token after the newest
one: the next step's draft. One draft per step per MTP layer present (DeepSeek-V3 ships one);
its acceptance is learned per bucket of the MTP's own probability (speculation.DraftConfidence),
which calibrates that probability online.

Drafts only ever change speed: the target verifies every one (greedy and seeded outputs are the
same with MTP on or off). Two places where the MTP cache is only approximately what a full
recompute would give, both affecting acceptance only: a prefix served from the radix cache keeps
the MTP entry its first writer computed at the last shared position (whose next token may differ
for this request), and a request preempted and recomputed refills it from scratch.
"""

from __future__ import annotations

import time

import torch

from deepinfer.engine.forward_batch import ForwardBatch

# calibration buckets of the MTP's own top-1 probability: acceptance is learned per bucket
_BUCKETS = (0.3, 0.6, 0.8, 0.9, 0.97)


def _bucket(p: float) -> int:
    return sum(p >= b for b in _BUCKETS)


class MtpDrafter:
    index = None  # no suffix index: drafts come from the model

    def __init__(self, runner, block_size: int):
        self.runner = runner
        self.block_size = block_size
        self.max_draft = 1  # the token after next; DeepSeek-V3's one MTP layer predicts exactly that
        self.seconds = 0.0  # time spent in MTP passes
        self.rows = 0  # MTP rows computed (stats, tests)

    def propose_for(self, seq, k: int) -> tuple[list[int], tuple]:
        """The draft computed after the sequence's last step, if it is still about the next token."""
        nd = seq.mtp_draft
        if nd is None or k < 1 or nd[0] != seq.num_tokens:
            return [], ("mtp", 0)
        return [nd[1]], ("mtp", nd[2])

    @torch.inference_mode()
    def after_step(self, step) -> None:
        """Run the MTP rows that the step made possible (see the module doc) and keep each sequence's
        next draft on it. step.hidden holds the target's final hidden state of every query row."""
        t0 = time.perf_counter()
        runs = []  # (seq, first position, input tokens, first hidden row, gives the next draft)
        flat = 0
        for e in step.entries:
            row0, flat = flat, flat + e.num_tokens
            seq = e.seq
            if seq.is_finished or step.id in seq.discarded:
                continue
            tokens = seq.all_token_ids
            known = len(tokens)
            while known and tokens[known - 1] < 0:  # the overlapped loop's placeholders, at the tail
                known -= 1
            last = min(e.start + e.num_tokens - 1, known - 2)
            if last < e.start:
                continue
            runs.append((seq, e.start, tokens[e.start + 1 : last + 2], row0, last == known - 2))
        if not runs:
            return
        # single-token rows first, as ForwardBatch wants them
        runs.sort(key=lambda r: not (len(r[2]) == 1 and r[1] > 0))
        logit_rows, owners, n_rows = [], [], 0
        for seq, _, toks, _, drafts in runs:
            n_rows += len(toks)
            if drafts:
                logit_rows.append(n_rows - 1)
                owners.append(seq)
            else:
                seq.mtp_draft = None
        hidden = step.hidden
        rows = torch.cat([hidden[r0 : r0 + len(t)] for _, _, t, r0, _ in runs])
        batch = ForwardBatch.build([r[2] for r in runs], [r[1] for r in runs], [r[0].block_table for r in runs],
                                   logit_rows, self.block_size)
        logits = self.runner.forward_mtp(self.runner.prepare(batch, mtp_depth=0), rows)
        if owners:
            p, tok = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            for seq, t, q in zip(owners, tok.tolist(), p.tolist()):
                seq.mtp_draft = (seq.num_tokens, t, _bucket(q))
        self.rows += n_rows
        self.seconds += time.perf_counter() - t0
