"""Confidence-scheduled verification: how many of each sequence's draft tokens the next step verifies.

Every draft position carries a confidence, the probability that it is accepted given that the
drafts before it were: learned online per (drafter, match length, position) from what verification
accepted (a Beta prior of `PRIOR_ACCEPT` over `PRIOR_WEIGHT` trials until data arrives). A slot's
survival probability is the product of the confidences up to it. Per step, slots are admitted in
order of survival probability while the expected tokens per second of the step rises, under a cost
model of a forward pass over T tokens measured when the engine starts. At batch 1 on a
bandwidth-bound CPU a few more tokens cost almost nothing, so every likely draft is verified; at
large batches the forward is compute-bound, each slot costs its share, and only near-certain drafts
are (no user flag needed for that).

Three corrections keep it from costing time where it cannot pay (the 0.97x floor):
- the cost model is refreshed online, per size, from the decode steps the engine runs *without*
  drafts (the start-up measurement is of bare forward passes; a real step adds sampling and host
  work);
- a draft slot's price is learned from the steps that verify drafts: what such a step took beyond
  the cost model's time for its token count, per admitted draft (`slot_extra`: sampling and
  acceptance of the extra rows, attention over several query tokens per sequence). Before this
  term, at batch 128 the budget admitted ~21 drafts per step whose forward-shape price looked
  fine, and the run was 0.94x of no speculation; a price learned from the steps themselves cannot
  drift from what they cost;
- drafting itself (host time, ~10 us per sequence) backs off: a step whose admitted drafts are not
  expected to save more time than proposing them took (on average over recent rounds) is followed
  by 1, 2, 4 .. 16 steps that propose nothing (those steps also keep the no-draft cost current).
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass

from deepinfer.engine.sequence import Sequence

PRIOR_ACCEPT = 0.5
PRIOR_WEIGHT = 4.0
# a slot counts for this share of its survival probability when it is weighed against its cost:
# confidences are estimates and forward times noisy, so a slot that merely breaks even is left out
DISCOUNT = 0.95
EMA = 0.2  # weight of the newest observation in the online corrections
MAX_BACKOFF = 16  # most steps drafting is paused for after a step where it did not pay
PROBE_EVERY = 4  # planning rounds in a row that admit nothing, after which one draft is verified anyway


class ForwardCost:
    """Seconds of one step over T query tokens: piecewise linear between the points measured at
    start-up (forward passes in decode shape; extrapolated from the last two), each point rescaled
    by what the steps the engine then runs near it take (observe)."""

    def __init__(self, points: list[tuple[int, float]]):
        pts = sorted(points)
        if len(pts) < 2:
            raise ValueError("ForwardCost needs at least two measured points")
        self.T = [t for t, _ in pts]
        # monotone: a larger batch never costs less (measurement noise can say otherwise)
        self.s = []
        for _, s in pts:
            self.s.append(max(s, self.s[-1]) if self.s else s)
        self.scale = 1.0  # observed / modelled time over every step seen (EMA)
        # per measured point: observed / modelled time of the steps nearest it (None: none seen yet,
        # the nearest seen point's factor stands in). A verify step of B sequences x (1 + k) tokens costs more
        # than B x (1 + k) single decodes (the start-up shape) in host work and attention; learning
        # per size lets the marginal cost of a draft follow what verify steps really take.
        self.factor: list[float | None] = [None] * len(self.T)
        self._refresh()

    def __call__(self, T: int) -> float:
        i = bisect.bisect_left(self.T, T)
        if i < len(self.T) and self.T[i] == T:
            return self._pts[i]
        i = min(max(i, 1), len(self.T) - 1)
        t0, t1, s0, s1 = self.T[i - 1], self.T[i], self._pts[i - 1], self._pts[i]
        return max(s0 + (s1 - s0) * (T - t0) / (t1 - t0), 1e-9)

    def _refresh(self) -> None:
        """The rescaled points, kept monotone (a size seen only under load must not make a larger,
        unseen size look cheaper than it)."""
        seen = [i for i, f in enumerate(self.factor) if f is not None]
        pts: list[float] = []
        for i, s in enumerate(self.s):
            f = self.factor[i]
            if f is None:  # an unseen size takes the factor of the nearest seen one
                f = self.factor[min(seen, key=lambda j: abs(j - i))] if seen else self.scale
            v = f * s
            pts.append(max(v, pts[-1]) if pts else v)
        self._pts = pts

    def _measured(self, T: int) -> float:
        i = bisect.bisect_left(self.T, T)
        if i < len(self.T) and self.T[i] == T:
            return self.s[i]
        i = min(max(i, 1), len(self.T) - 1)
        t0, t1, s0, s1 = self.T[i - 1], self.T[i], self.s[i - 1], self.s[i]
        return max(s0 + (s1 - s0) * (T - t0) / (t1 - t0), 1e-9)

    def observe(self, T: int, seconds: float) -> None:
        """A step over T query tokens took `seconds`: move the overall scale and the factor of the
        measured point nearest T (in log size) towards it."""
        if T < 1 or not seconds > 0:
            return
        ratio = min(max(seconds / self._measured(T), 0.25), 8.0)  # one stalled step must not swing it
        self.scale += EMA * (ratio - self.scale)
        j = min(range(len(self.T)), key=lambda k: abs(math.log(self.T[k]) - math.log(T)))
        f = self.factor[j]
        f = self.scale if f is None else f  # (starts from the overall level, then learns its own)
        self.factor[j] = f + EMA * (ratio - f)
        self._refresh()


class DraftConfidence:
    """P(draft j accepted | drafts before it accepted), per key (e.g. the n-gram match length)."""

    def __init__(self, max_draft: int):
        self.max_draft = max_draft
        self._trials: dict[tuple, list[float]] = {}
        self._hits: dict[tuple, list[float]] = {}

    def confidences(self, key: tuple, k: int) -> list[float]:
        trials = self._trials.get(key)
        hits = self._hits.get(key)
        if trials is None:
            return [PRIOR_ACCEPT] * k
        return [(hits[j] + PRIOR_ACCEPT * PRIOR_WEIGHT) / (trials[j] + PRIOR_WEIGHT) for j in range(k)]

    def observe(self, key: tuple, verified: int, accepted: int) -> None:
        """verified drafts of one sequence in one step, of which the first `accepted` were accepted."""
        trials = self._trials.setdefault(key, [0.0] * self.max_draft)
        hits = self._hits.setdefault(key, [0.0] * self.max_draft)
        for j in range(min(accepted + 1, verified)):  # draft j was tried only if all before it passed
            trials[j] += 1
            hits[j] += j < accepted


def choose_lengths(survival: list[list[float]], base_tokens: int, base_gain: float, cost: ForwardCost,
                   draft_frac: float = 0.0, slot_extra: float = 0.0) -> list[int]:
    """How many drafts of each sequence to verify: admit (sequence, position) slots by survival
    probability, keeping the count that maximises expected tokens gained per second.
    draft_frac: drafts made by a model pass (self-drafting) cost a pass per draft position over the
    sequences drafting that far, each `draft_frac` of a full forward of that size.
    slot_extra: seconds a verified draft costs beyond the forward of its token (learned online)."""
    return _choose(survival, base_tokens, base_gain, cost, draft_frac, slot_extra)[0]


def _choose(survival: list[list[float]], base_tokens: int, base_gain: float,
            cost: ForwardCost, draft_frac: float = 0.0, slot_extra: float = 0.0) -> tuple[list[int], float, float]:
    """(lengths, expected seconds saved by them, the survival of the last slot admitted): saved is
    the time the step's expected tokens would take at the no-draft rate, minus the time the step
    with the drafts takes."""
    slots = sorted(((-p, j, i) for i, ps in enumerate(survival) for j, p in enumerate(ps)))
    gain, T = base_gain, base_tokens
    best_rate = gain / cost(T) if T else 0.0
    best_n = 0
    extra = best_extra = 0.0  # seconds of draft passes and of the slots' learned extra cost
    at_pos: dict[int, int] = {}  # draft position -> sequences drafting that far
    for n, (neg_p, j, _) in enumerate(slots, 1):
        gain -= neg_p * DISCOUNT
        T += 1
        if draft_frac:
            m = at_pos.get(j, 0)
            extra += draft_frac * (cost(m + 1) - (cost(m) if m else 0.0))
            at_pos[j] = m + 1
        extra += slot_extra
        rate = gain / (cost(T) + extra)
        if rate > best_rate:
            best_rate, best_n, best_extra = rate, n, extra
    lengths = [0] * len(survival)
    for _, _, i in slots[:best_n]:
        lengths[i] += 1
    saved = 0.0
    if best_n and base_gain > 0 and base_tokens:
        gain = base_gain - sum(neg_p for neg_p, _, _ in slots[:best_n]) * DISCOUNT
        saved = gain * cost(base_tokens) / base_gain - cost(base_tokens + best_n) - best_extra
    return lengths, saved, (-slots[best_n - 1][0] if best_n else 1.0)


@dataclass
class VerifyPlan:
    """What one step verifies: the sequences with drafts and the draft tokens offered vs admitted."""

    proposed: int = 0
    admitted: int = 0


class Speculator:
    """Proposes drafts for decoding sequences, sizes their verification, and learns from results."""

    def __init__(self, drafter, cost: ForwardCost | None, draft_frac: float = 0.0):
        self.drafter = drafter  # NgramDrafter, SelfDrafter or MtpDrafter (max_draft, index, propose_*)
        # (sequence, most drafts) -> (drafts, key): MtpDrafter keeps drafts per sequence (propose_for),
        # the others draft from the sequence's tokens (propose_keyed); chosen once, not per sequence
        self._propose = getattr(drafter, "propose_for", None) or (
            lambda seq, k: drafter.propose_keyed(seq.all_token_ids, k))
        self._observe_drafts = getattr(drafter, "observe_drafts", None)  # per-draft calibration, if it learns one
        self.cost = cost  # None: verify every proposed draft (no budget)
        self.draft_frac = draft_frac  # cost of a draft pass / a full forward (0: drafts are free)
        self.confidence = DraftConfidence(drafter.max_draft)
        self.slot_extra = 0.0  # seconds a verified draft costs beyond its token's forward cost (EMA)
        self._drafter_s = 0.0  # the self-drafter's pass seconds already accounted for
        # survival probability of the last slot the latest plan admitted: a model drafter that learns
        # more once its drafts are drawn cuts runs whose survival falls below it (0: cut nothing)
        self.min_survival = 0.0
        self._dry = 0  # planning rounds in a row that admitted nothing
        self.probes = 0  # single drafts verified as probes (stats)
        self.propose_s = 0.0  # host seconds one round of drafting takes (EMA)
        self.saved_s = 0.0  # seconds one round's admitted drafts are expected to save (EMA, zeros incl.)
        self._backoff = 0  # steps drafting pauses for after the next one that does not pay
        self._skip = 0  # steps left in the current pause
        self.paused_steps = 0  # steps that proposed nothing because of a pause (stats)

    def propose(self, seqs: list[tuple[Sequence, int]], base_tokens: int, base_gain: float) -> VerifyPlan:
        """seqs: (decoding sequence, most drafts it may take); base_tokens / base_gain: the step's query
        tokens and the tokens it yields without drafts. Sets seq.draft_token_ids (and the key its
        acceptance is learned under) for the next step."""
        if self._skip > 0:
            self.skip_step()
            return VerifyPlan()
        t0 = time.perf_counter()
        drafted: list[tuple[Sequence, list[int], tuple]] = []
        for seq, room in seqs:
            tokens, key = self._propose(seq, room)
            if tokens:
                drafted.append((seq, tokens, key))
        plan = VerifyPlan(proposed=sum(len(t) for _, t, _ in drafted))
        if self.cost is None:
            for seq, tokens, key in drafted:
                seq.draft_token_ids, seq.draft_key = tokens, key
            plan.admitted = plan.proposed
            return plan
        if not drafted:
            self._pace(0.0, t0)
            return plan
        survival = []
        for _, tokens, key in drafted:
            p, ps = 1.0, []
            for c in self.confidence.confidences(key, len(tokens)):
                p *= c
                ps.append(p)
            survival.append(ps)
        lengths, saved, self.min_survival = _choose(survival, base_tokens, base_gain, self.cost, self.draft_frac,
                                                    self.slot_extra)
        if any(lengths):
            self._dry = 0
        else:
            self._dry += 1
            if self._dry >= PROBE_EVERY:
                # a probe: the likeliest slot is verified anyway. Without it a start-up cost point
                # measured during a stall (seen: T = 2 at 1.6x T = 1 at batch 1, where it is ~1.05x)
                # or a low prior keeps every draft out, and nothing would ever correct either
                self._dry = 0
                i = max(range(len(survival)), key=lambda k: survival[k][0])
                lengths[i] = 1
                self.probes += 1
                self.min_survival = 0.0  # a model drafter must not cut the probe
        for (seq, tokens, key), k in zip(drafted, lengths):
            seq.draft_token_ids = tokens[:k]
            seq.draft_key = key
            plan.admitted += k
        self._pace(saved, t0)
        return plan

    @property
    def paused(self) -> bool:
        """Drafting is paused for the next step (the overlapped loop may plan it ahead)."""
        return self._skip > 0

    def skip_step(self) -> None:
        """A step that drafts nothing because drafting is paused."""
        self._skip -= 1
        self.paused_steps += 1

    def _pace(self, saved: float, t0: float) -> None:
        """Back off drafting while a round of it saves less, on average, than it costs (at batch 1 a
        round costs ~20 us against a 30 ms step, so it never pauses there)."""
        self.propose_s += EMA * (time.perf_counter() - t0 - self.propose_s)
        self.saved_s += EMA * (saved - self.saved_s)
        if self.saved_s > self.propose_s:
            self._backoff = 0
        else:
            self._backoff = min(max(1, 2 * self._backoff), MAX_BACKOFF)
            self._skip = self._backoff

    def observe_step(self, num_tokens: int, drafts: int, seconds: float) -> None:
        """A decode step over num_tokens query tokens, `drafts` of them budgeted drafts, took
        `seconds`. Without drafts it refreshes the cost model; with them, what it took beyond the
        model's time for num_tokens is the drafts' extra price (never below 0: a step that ran faster
        than modelled says the machine sped up, which the next draft-free step teaches the model)."""
        if self.cost is None or num_tokens < 1 or not seconds > 0:
            return
        passes = self.drafter.seconds - self._drafter_s if self.draft_frac else 0.0
        self._drafter_s += passes  # a self-drafter's passes are priced by draft_frac, not here
        if drafts <= 0:
            self.cost.observe(num_tokens, seconds)
            # a price only drafted steps can correct must not keep drafting off for good: it fades
            # while nothing is drafted, so a later plan tries drafts again and re-measures them
            self.slot_extra *= 1.0 - EMA / 4
            return
        seconds -= passes
        modelled = self.cost(num_tokens)
        if seconds < modelled:
            # faster than the model's time for num_tokens tokens: that time is too high (a noisy
            # start-up measurement; at batch 1 the draft-free size T = 5 is never run to correct it)
            self.cost.observe(num_tokens, seconds)
        per_slot = max(0.0, seconds - modelled) / drafts
        # bounded like the cost model's observations: one stalled step must not price drafts out for long
        per_slot = min(per_slot, 4.0 * modelled / num_tokens)
        self.slot_extra += EMA * (per_slot - self.slot_extra)

    def observe(self, seq: Sequence, verified: int, accepted: int) -> None:
        if seq.draft_key is not None:
            self.confidence.observe(seq.draft_key, verified, accepted)
            if self._observe_drafts is not None:
                self._observe_drafts(seq, verified, accepted)

    def finished(self, seq: Sequence) -> None:
        """A finished request's output joins the suffix index other requests draft from."""
        if self.drafter.index is not None and seq.finish_reason in ("stop", "length"):
            self.drafter.index.add(seq.output_token_ids)
