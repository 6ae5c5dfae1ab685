"""Continuous batching: decide which tokens of which sequences the next forward pass computes.

Each step has a token budget. Running sequences go first (one token each when decoding, plus any
draft tokens to verify, or their next prefill chunk / jump-forward tokens), then waiting sequences are admitted with a chunk of
their prompt while budget, sequence slots and KV blocks last. When blocks run out for a running
sequence, the latest-arrived running sequence is preempted (its KV is dropped and recomputed later;
its computed pages stay in the radix cache, so the recompute is often a cache hit).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.kv_manager import KVCacheManager
from deepinfer.engine.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens (incl. drafts)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence, release: bool = True) -> None:
        """Take a sequence out of the queues (finished or aborted); release its blocks unless the
        caller does it later (its KV is still being written by a forward pass in flight)."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        if release:
            self.kv.release(seq)

    # -------------------------------------------------------------------------------------------
    def schedule(self, allow_preempt: bool = True) -> SchedulerOutput | None:
        """Plan the next step. With allow_preempt=False (planning while a forward pass is in
        flight) returns None instead of preempting when the running sequences need more blocks."""
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        if not allow_preempt and not self._running_fits(budget):
            return None

        # 1. running sequences, oldest first; preempt the newest when blocks run out
        self.running.sort(key=lambda s: s.arrival)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._running_tokens(seq, budget)
            if n == 0:
                break
            if seq.draft_token_ids:
                del seq.draft_token_ids[n - 1 :]
            while not self.kv.allocate_for(seq, seq.num_computed_tokens + n):
                if seq.draft_token_ids:  # short of blocks: verify no drafts rather than preempt
                    seq.draft_token_ids.clear()
                    n = 1
                    continue
                # the newest sequence whose blocks can make room (with one KV pool per rank: on seq's)
                victim = next(v for v in reversed(self.running) if self.kv.same_pool(v, seq))
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            # seq itself was preempted (the newest of its pool); the ones after it, of other pools, go on

        # 2. admit waiting sequences
        if not out.preempted:
            self._order_waiting()
            admitted: list[Sequence] = []
            idx = deferred = 0
            while idx < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
                seq = self.waiting[idx]
                first_admission = seq.num_preemptions == 0 and not seq.output_token_ids
                matched = self.kv.match_prefix(seq)
                if self._would_recompute_shared_prefix(seq, matched, admitted):
                    # a request admitted this step is computing the same prefix: wait one step and
                    # read it from the cache instead of computing it twice
                    self.kv.unmatch(seq)
                    idx += 1
                    deferred += 1
                    if deferred >= self.config.lpm_window:
                        break
                    continue
                remaining = seq.num_tokens - seq.num_computed_tokens
                n = self._chunk(remaining, budget, allow_over=not out.scheduled)
                if n == 0 or not self.kv.allocate_for(seq, seq.num_computed_tokens + n):
                    self.kv.unmatch(seq)
                    break
                if first_admission:
                    seq.num_cached_tokens = matched
                del self.waiting[idx]
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                admitted.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        return out

    def _would_recompute_shared_prefix(self, seq: Sequence, matched: int, admitted: list[Sequence]) -> bool:
        if not self.kv.caching or not admitted:
            return False
        need = matched + max(self.kv.block_size, 16)
        tokens = seq.all_token_ids
        if len(tokens) <= need:
            return False
        for other in admitted[-8:]:
            if common_prefix_len(tokens, other.all_token_ids) >= need:
                return True
        return False

    def _running_fits(self, budget: int) -> bool:
        demands = []
        for seq in self.running:
            n = self._running_tokens(seq, budget)
            if n <= 0:
                break
            demands.append((seq, seq.num_computed_tokens + n))
            budget -= n
            if budget <= 0:
                break
        return self.kv.fits(demands)

    def _running_tokens(self, seq: Sequence, budget: int) -> int:
        """Query tokens of a running sequence this step: its next prefill chunk, or its last token
        plus the draft tokens to verify (as many as the budget leaves room for)."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        if remaining != 1:
            return self._chunk(remaining, budget)
        return min(1 + len(seq.draft_token_ids), budget)

    def _chunk(self, remaining: int, budget: int, allow_over: bool = False) -> int:
        if remaining <= budget:
            return remaining
        if self.config.enable_chunked_prefill:
            return budget
        return remaining if allow_over else 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids.clear()
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _order_waiting(self) -> None:
        """Longest-cached-prefix first within a bounded window at the head of the queue (lpm)."""
        if self.config.schedule_policy != "lpm" or not self.kv.caching or len(self.waiting) < 2:
            return
        w = min(self.config.lpm_window, len(self.waiting))
        head = [self.waiting.popleft() for _ in range(w)]
        # preempted sequences keep priority; others by cached prefix length, stable by arrival
        head.sort(key=lambda s: (s.num_preemptions == 0, -self.kv.cached_prefix_len(s.all_token_ids), s.arrival))
        self.waiting.extendleft(reversed(head))


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (binary search over C-speed slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
