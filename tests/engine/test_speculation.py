"""Confidence-scheduled verification: the cost model, the learned confidences, the admission rule."""

from __future__ import annotations

import pytest

from deepinfer.engine.drafter import NgramDrafter
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.speculation import PRIOR_ACCEPT, DraftConfidence, ForwardCost, Speculator, choose_lengths


def test_forward_cost_interpolates_and_is_monotone():
    c = ForwardCost([(1, 1.0), (4, 1.6), (8, 1.5), (16, 3.1)])  # 8 measured faster than 4: noise
    assert c(1) == 1.0 and c(4) == pytest.approx(1.6) and c(8) == pytest.approx(1.6)
    assert c(2) == pytest.approx(1.2)
    assert c(12) == pytest.approx(1.6 + 1.5 * 4 / 8)
    assert c(32) == pytest.approx(3.1 + 1.5 * 16 / 8)  # extrapolated from the last segment
    with pytest.raises(ValueError):
        ForwardCost([(1, 1.0)])


def test_confidence_learns_conditional_acceptance():
    conf = DraftConfidence(max_draft=3)
    assert conf.confidences(("ngram", 2), 3) == [PRIOR_ACCEPT] * 3
    for _ in range(50):
        conf.observe(("ngram", 2), verified=3, accepted=1)  # draft 1 always passes, draft 2 never
    c = conf.confidences(("ngram", 2), 3)
    assert c[0] > 0.9 and c[1] < 0.1
    assert c[2] == pytest.approx(PRIOR_ACCEPT)  # never tried: draft 2 always failed before it
    assert conf.confidences(("ngram", 3), 1) == [PRIOR_ACCEPT]  # keys are separate


def test_bandwidth_bound_step_verifies_everything_likely():
    flat = ForwardCost([(1, 1.0), (64, 1.05)])  # batch-1 CPU decode: more tokens cost ~nothing
    lengths = choose_lengths([[0.9, 0.8, 0.6, 0.3]], base_tokens=1, base_gain=1.0, cost=flat)
    assert lengths == [4]


def test_compute_bound_step_verifies_only_near_certain_drafts():
    # a fixed part plus a cost per token: a slot pays only if its survival beats G * b / cost(T) = 0.72
    linear = ForwardCost([(1, 0.51), (1024, 0.5 + 10.24)])
    survival = [[0.99, 0.98], [0.6, 0.3]] + [[0.5]] * 126
    lengths = choose_lengths(survival, base_tokens=128, base_gain=128.0, cost=linear)
    assert lengths[0] == 2 and lengths[1] == 0 and sum(lengths[2:]) == 0
    # the same drafts at batch 1 are all worth verifying
    assert choose_lengths([[0.6, 0.3]], base_tokens=1, base_gain=1.0, cost=linear) == [2]


def test_slots_of_a_sequence_are_admitted_in_order():
    flat = ForwardCost([(1, 1.0), (8, 1.2)])
    lengths = choose_lengths([[1.0, 1.0, 1.0]], base_tokens=1, base_gain=1.0, cost=flat)
    assert lengths == [3]
    assert choose_lengths([], 4, 4.0, flat) == []


def _seq(tokens):
    return Sequence("r", list(tokens), SamplingParams(), arrival=0, rng_seed=0)


def test_speculator_sizes_and_learns():
    spec = Speculator(NgramDrafter(4), ForwardCost([(1, 1.0), (64, 2.26)]))  # 2% of a step per token
    seq = _seq([5, 6, 7, 8, 9, 5, 6, 7])
    plan = spec.propose([(seq, 4)], base_tokens=1, base_gain=1.0)
    assert plan.proposed == 4 and seq.draft_token_ids == [8, 9, 5, 6] and plan.admitted == 4
    for _ in range(100):
        spec.observe(seq, 4, 0)  # nothing is ever accepted: confidence collapses
    plan = spec.propose([(seq, 4)], base_tokens=1, base_gain=1.0)
    assert plan.proposed == 4 and plan.admitted == 0 and seq.draft_token_ids == []


def test_cost_model_follows_observed_steps():
    c = ForwardCost([(1, 1.0), (8, 1.0), (16, 1.2), (64, 2.0)])
    for _ in range(40):
        c.observe(8, 2.0)  # the machine now runs 2x slower than at start-up
    assert abs(c(8) - 2.0) < 0.05 and abs(c(64) - 4.0) < 0.1  # unseen sizes follow the nearest seen one
    for _ in range(40):
        c.observe(16, 3.6)  # verify steps near 16 tokens cost 3x their start-up measurement
    # the marginal cost of tokens past the batch now follows what those steps took
    assert abs(c(16) - 3.6) < 0.1 and abs(c(8) - 2.0) < 0.2 and c(12) > 2.5
    c.observe(8, 1000.0)  # one stalled step moves it boundedly
    assert c(8) < 2.0 * 2.5


def test_drafting_backs_off_while_it_does_not_pay():
    # a compute-bound cost curve (each token costs its share) and drafts that never get accepted
    spec = Speculator(NgramDrafter(4), ForwardCost([(1, 0.01), (1024, 10.24)]))
    seqs = [(_seq([5, 6, 7, 8, 9, 5, 6, 7]), 4) for _ in range(64)]
    for s, _ in seqs:
        for _ in range(50):
            spec.observe(s, 4, 0)
    proposing = [spec.propose(seqs, base_tokens=64, base_gain=64.0).proposed > 0 for _ in range(64)]
    # pauses double up to MAX_BACKOFF: far fewer drafting rounds than steps, but never none
    assert 2 <= sum(proposing) <= 10 and spec.paused_steps == proposing.count(False)


def test_drafting_never_pauses_where_it_pays():
    spec = Speculator(NgramDrafter(4), ForwardCost([(1, 0.03), (64, 0.031)]))  # batch 1, bandwidth-bound
    seq = _seq([5, 6, 7, 8, 9, 5, 6, 7])
    for _ in range(20):
        spec.observe(seq, 4, 4)
    assert all(spec.propose([(seq, 4)], base_tokens=1, base_gain=1.0).admitted == 4 for _ in range(30))
    assert spec.paused_steps == 0


def test_draft_price_is_learned_from_the_steps_that_verify_drafts():
    # start-up says drafts are almost free (a flat curve), but steps that verify 64 drafts take
    # twice the modelled time: the learned per-slot price must stop the budget admitting them
    cost = ForwardCost([(64, 1.0), (1024, 1.2)])
    spec = Speculator(NgramDrafter(4), cost)
    seqs = [(_seq([5, 6, 7, 8, 9, 5, 6, 7]), 4) for _ in range(64)]
    for s, _ in seqs:
        for _ in range(20):
            spec.observe(s, 4, 2)  # drafts 1-2 always pass, 3-4 never: survival ~0.95, ~0.9, ~0.05, ..
    first = spec.propose(seqs, base_tokens=64, base_gain=64.0).admitted
    assert first >= 64  # at the start-up price the likely drafts are worth verifying
    before = cost(64)
    for _ in range(30):
        spec.observe_step(64 + 64, 64, 2.0 * cost(128))
    assert cost(64) == before  # steps with drafts never move the no-draft cost model
    assert spec.slot_extra == pytest.approx(cost(128) / 64, rel=0.05)
    spec._skip = 0
    assert spec.propose(seqs, base_tokens=64, base_gain=64.0).admitted == 0
    # draft-free steps teach the cost model; the slot price only fades a little on them
    extra = spec.slot_extra
    spec.observe_step(64, 0, 2.0)
    assert cost(64) > before and 0.9 * extra < spec.slot_extra < extra


def test_a_step_faster_than_modelled_corrects_the_model_and_a_high_price_fades():
    cost = ForwardCost([(1, 1.0), (4, 2.0), (8, 2.2)])  # start-up overstated T = 4..8 (noise)
    spec = Speculator(NgramDrafter(4), cost)
    for _ in range(30):
        spec.observe_step(5, 4, 1.1)  # verify steps of 1 + 4 tokens take barely more than a decode
    assert cost(5) < 1.3 and spec.slot_extra == 0.0
    spec.slot_extra = 0.5  # a price learned under a stall ...
    for _ in range(50):
        spec.observe_step(1, 0, 1.0)  # ... fades while nothing is drafted, so drafts get retried
    assert spec.slot_extra < 0.1


def test_a_prefill_heavy_step_admits_no_uncertain_drafts():
    # compute-bound (10 ms a token): a step of 2,000 prompt tokens and 20 decodes. Counting every
    # token the step computes as its gain, a 0.9-likely draft costs a full token for 0.9 of one
    linear = ForwardCost([(1, 0.01), (4096, 40.96)])
    survival = [[0.9, 0.81]] * 20
    assert sum(choose_lengths(survival, base_tokens=2020, base_gain=2020.0, cost=linear)) == 0
    # (counting only the 20 decodes as the step's gain, the same drafts looked worth 40 slots)
    assert sum(choose_lengths(survival, base_tokens=2020, base_gain=20.0, cost=linear)) == 40


def test_a_stalled_start_up_point_is_probed_and_corrected():
    from deepinfer.engine.speculation import PROBE_EVERY

    # start-up measured T = 2.. during a stall: at batch 1 no draft looks worth its cost
    cost = ForwardCost([(1, 1.0), (2, 2.0), (4, 2.1), (8, 2.2)])
    spec = Speculator(NgramDrafter(4), cost)
    seq = _seq([5, 6, 7, 8, 9, 5, 6, 7])
    admitted = []
    for _ in range(6 * PROBE_EVERY):
        spec._skip = 0  # (pauses are tested elsewhere)
        plan = spec.propose([(seq, 4)], base_tokens=1, base_gain=1.0)
        admitted.append(plan.admitted)
        k = plan.admitted
        spec.observe(seq, k, k)  # the drafts pass
        spec.observe_step(1 + k, k, 1.05 if k else 1.0)  # and a verify step costs ~a decode
    assert spec.probes >= 1 and admitted[PROBE_EVERY - 1] == 1  # the first probe, after PROBE_EVERY dry rounds
    assert all(a == 4 for a in admitted[-4:])  # an accepted probe: drafting runs normally from then on
    assert cost(5) < 1.8  # (modelled 2.1 at start) and the verify steps, faster than modelled, corrected the stalled points
