"""From a finished forward pass to tokens: prompt logprobs, grammar masks, sampling, and the
verification of draft tokens.

Exactness of verification: row j of a sequence is drawn from the target's logits after drafts
1..j, with the same (seed, position) uniform, penalties and bans as plain decoding would use there.
Draft j + 1 is accepted only when it equals the token drawn at row j, so every accepted token is
the token plain decoding would have drawn: outputs are identical with drafts or without.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deepinfer.engine.outputs import TokenLogprob
from deepinfer.engine.sampler import Sampler, SamplingRow, compute_logprobs
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.stats import EngineStats
from deepinfer.engine.step_planner import Step, StepEntry
from deepinfer.engine.structured_output import StructuredOutputs


@dataclass
class StepSamples:
    tokens: torch.Tensor  # [num_slots] every drawn token (the next step's placeholders read these)
    accepted: list[list[int]]  # per entry: the tokens it gains this step ([] when it samples nothing)
    logprobs: list[list[TokenLogprob | None]]  # per entry, per accepted token


def accepted_run(samples: list[int], drafts: list[int], valid: int) -> list[int]:
    """The tokens a sequence gains: sample 0, then sample j while draft j equals sample j - 1
    (and row j had a valid grammar mask)."""
    out = samples[:1]
    for j in range(1, min(len(samples), valid)):
        if samples[j - 1] != drafts[j - 1]:
            break
        out.append(samples[j])
    return out


class StepSampler:
    def __init__(self, sampler: Sampler, structured: StructuredOutputs, eos_token_ids: list[int], stats: EngineStats):
        self.sampler = sampler
        self.structured = structured
        self.eos_token_ids = eos_token_ids
        self.stats = stats

    @torch.inference_mode()  # the logits are an inference tensor, modified in place (masks, penalties)
    def sample(self, step: Step) -> StepSamples:
        t0 = time.perf_counter()
        logits = step.logits
        for e in step.entries:
            if e.prompt_rows is not None:
                r0, n = e.prompt_rows
                record_prompt_logprobs(e.seq, e.start, e.num_tokens, logits[r0 : r0 + n])
        active = [i for i, e in enumerate(step.entries)
                  if e.slot >= 0 and step.id not in e.seq.discarded and not e.seq.is_finished]
        if self.structured.adopted:  # some were admitted while their constraint compiled: bind those now
            pending = [step.entries[i].seq for i in active if step.entries[i].seq.grammar_pending is not None]
            if pending:
                self.structured.bind_pending(pending)
        tokens = torch.zeros(step.num_slots, dtype=torch.long, device=logits.device)
        accepted: list[list[int]] = [[] for _ in step.entries]
        lps: list[list[TokenLogprob | None]] = [[] for _ in step.entries]
        if active:
            want, slots, rows, mask_rows = [], [], [], []
            for i in active:
                e = step.entries[i]
                mask_rows.append((e.seq, len(want), e.drafts))
                for j in range(e.num_samples):
                    want.append(e.sample_row + j)
                    slots.append(e.slot + j)
                    rows.append(self._sampling_row(e, j))
            if want == list(range(logits.shape[0])):
                sel = logits  # the common case: every row, in order (no copy of [B, vocab])
            else:
                sel = logits.index_select(0, torch.tensor(want, dtype=torch.long, device=logits.device))
            top_n = [r.params.logprobs for r in rows]
            raw = sel.clone() if any(n is not None for n in top_n) else None
            batch = self.sampler.prepare(rows, sel.shape[1], sel.device)
            if self.sampler.fused_route(batch, sel.device):  # the kernel applies the mask in its pass
                valid, bitmask = self.structured.device_masks(sel, mask_rows, step.id)
                tok_t = self.sampler.sample(sel, batch, bitmask=bitmask)
            else:
                valid = self.structured.apply_masks(sel, mask_rows, step.id)
                tok_t = self.sampler.sample(sel, batch)
            if len(slots) == step.num_slots and slots == list(range(step.num_slots)):
                tokens = tok_t.long()  # every slot, in order (the common case: no index tensor to build)
            else:
                tokens[torch.tensor(slots, dtype=torch.long, device=tokens.device)] = tok_t
            row_lps = compute_logprobs(raw, tok_t, top_n) if raw is not None else [None] * len(rows)
            drawn = tok_t.tolist()
            r = 0
            for i, v in zip(active, valid):
                e = step.entries[i]
                ns = e.num_samples
                accepted[i] = accepted_run(drawn[r : r + ns], e.drafts, v)
                lps[i] = row_lps[r : r + len(accepted[i])]
                r += ns
        self.stats.sample_time += time.perf_counter() - t0
        return StepSamples(tokens, accepted, lps)

    def _sampling_row(self, e: StepEntry, j: int) -> SamplingRow:
        """The draw at row j of an entry: after its output so far and drafts 1..j."""
        seq, p = e.seq, e.seq.params
        n_out = e.ph_index + j
        banned: list[int] = []
        if n_out < p.min_tokens:
            banned = sorted(set(self.eos_token_ids) | set(p.stop_token_ids))
        # only the penalties read the output so far: don't copy it every step for rows without them
        penalised = p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
        out = seq.output_token_ids[: e.ph_index] + e.drafts[:j] if penalised else []
        return SamplingRow(p, seq.rng_seed, e.sample_pos + j, seq.prompt_token_ids, out, banned)


def record_prompt_logprobs(seq: Sequence, nc: int, n: int, logits: torch.Tensor) -> None:
    plen = len(seq.prompt_token_ids)
    # the logits at position p predict token p + 1
    targets = [p + 1 for p in range(nc, nc + n) if p + 1 < plen]
    if not targets:
        return
    lp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    tgt = torch.tensor([seq.prompt_token_ids[t] for t in targets], dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, tgt[:, None]).squeeze(1).tolist()
    k = seq.params.prompt_logprobs or 0
    tops = lp.topk(k, dim=-1) if k else None
    for j, t in enumerate(targets):
        top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist())) if tops is not None else []
        seq.prompt_logprobs[t] = TokenLogprob(seq.prompt_token_ids[t], chosen[j], top)
