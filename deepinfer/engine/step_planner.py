"""Step planning: a scheduler decision becomes a `Step` (what each sequence computes and samples)
and the runner's `ForwardBatch` (plain tensors).

Every sequence that samples gets a placeholder token now (-(slot + 1)), so the next step can be
planned before this one's tokens are known (overlap mode); the output processor writes the real
token in. A sequence verifying k draft tokens computes 1 + k query tokens and samples 1 + k rows:
row j is the target's token after drafts 1..j.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.scheduler import SchedulerOutput
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.stats import EngineStats


@dataclass
class StepEntry:
    """One sequence's part of a step."""

    seq: Sequence
    start: int  # seq.num_computed_tokens at launch: the position of its first query token
    num_tokens: int  # query tokens this step (incl. drafts)
    completes: bool  # after this step every token has KV, so the next one is sampled
    drafts: list[int] = field(default_factory=list)  # draft tokens verified this step
    prompt_rows: tuple[int, int] | None = None  # (first logits row, count) of prompt-logprob rows
    sample_row: int = -1  # logits row of the first sample; the drafts' rows follow (-1: no sample)
    sample_pos: int = -1  # position of the first token drawn
    ph_index: int = -1  # index of its placeholder in seq.output_token_ids
    slot: int = -1  # index of the first sample in the step's sampled-token tensor

    @property
    def num_samples(self) -> int:
        return 0 if self.slot < 0 else 1 + len(self.drafts)


@dataclass
class Step:
    """One launched forward pass: its entries, where its samples go, and its result."""

    id: int
    entries: list[StepEntry]
    num_slots: int
    seqs: set = field(default_factory=set)  # id() of the sequences in this batch
    future: Any = None
    logits: Any = None  # [R, V] once the forward pass is done
    hidden: Any = None  # [T, hidden] final hidden states of every query row (speculative="mtp" only)
    forward_s: float = 0.0  # seconds its forward pass took
    t_start: float = 0.0  # synchronous loop: when the step began (drafting, scheduling), for its cost

    @property
    def num_tokens(self) -> int:
        """Query tokens of the step (prompt chunks, decodes and drafts)."""
        return sum(e.num_tokens for e in self.entries)


def plan_step(sched: SchedulerOutput, step_id: int, block_size: int, kv: KVCacheManager,
              stats: EngineStats) -> tuple[Step, ForwardBatch]:
    """Lay out a scheduled batch (single-token decodes first) and advance the sequences' bookkeeping."""
    single = [s for s in sched.scheduled if s.num_tokens == 1 and s.seq.num_computed_tokens > 0]
    rest = [s for s in sched.scheduled if not (s.num_tokens == 1 and s.seq.num_computed_tokens > 0)]
    entries: list[StepEntry] = []
    tokens: list[list[int]] = []
    rows: list[int] = []
    flat = slot = 0
    for s in single + rest:
        seq, n = s.seq, s.num_tokens
        nc = seq.num_computed_tokens
        decoding = nc == seq.num_tokens - 1
        drafts = list(seq.draft_token_ids) if decoding else []
        seq.draft_token_ids.clear()
        e = StepEntry(seq, nc, n, completes=nc + n >= seq.num_tokens, drafts=drafts)
        if seq.params.prompt_logprobs is not None and nc < len(seq.prompt_token_ids):
            e.prompt_rows = (len(rows), n)
            rows.extend(range(flat, flat + n))
        if e.completes and seq.params.max_tokens > 0:
            k = len(drafts)
            if e.prompt_rows is None:
                rows.extend(range(flat + n - 1 - k, flat + n))
            e.sample_row = len(rows) - 1 - k
            e.sample_pos = seq.num_tokens
            e.ph_index = len(seq.output_token_ids)
            e.slot = slot
            slot += 1 + k
        tokens.append(seq.token_span(nc, nc + n - len(drafts)) + drafts if drafts else seq.token_span(nc, nc + n))
        entries.append(e)
        flat += n
    batch = ForwardBatch.build(tokens, [e.start for e in entries], [e.seq.block_table for e in entries], rows,
                               block_size)
    step = Step(step_id, entries, slot, {id(e.seq) for e in entries})
    for e in entries:
        seq = e.seq
        plen = len(seq.prompt_token_ids)
        stats.computed_prompt_tokens += max(0, min(plen, e.start + e.num_tokens) - e.start)
        seq.num_computed_tokens += e.num_tokens
        if e.num_tokens > 1 and not e.drafts:
            kv.cache_computed(seq)  # share a fresh prefill with requests admitted next
        if e.slot >= 0:
            seq.output_token_ids.append(-(e.slot + 1))
            seq.placeholders.append(step_id)
    stats.num_steps += 1
    stats.num_forward_tokens += batch.num_tokens
    return step, batch
