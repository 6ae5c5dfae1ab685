"""The three select scoring methods on hand-made logprobs."""

import pytest

from deepinfer.errors import InvalidRequestError
from deepinfer.lang.choices import (
    greedy_token_selection,
    resolve_method,
    token_length_normalized,
    unconditional_likelihood_normalized,
)

# "organ" / "organism" / a long word whose later tokens are near-certain once started
COND = [[-0.1], [-0.1, -0.3], [-0.4, -0.01, -0.01, -0.01, -0.01]]
UNCOND = [[-0.5], [-0.5, -2.0], [-0.2, -0.01, -0.01, -0.01, -0.01]]


def test_token_length_normalized_prefers_best_mean():
    i, scores = token_length_normalized.decide(COND)
    assert scores["normalized_prompt_logprobs"] == pytest.approx([-0.1, -0.2, -0.088])
    assert i == 2


def test_greedy_pads_short_choices_with_their_mean():
    i, scores = greedy_token_selection.decide(COND)
    # organ and organism tie on the first token; organ's padded mean (-0.1) beats organism's -0.3
    assert i == 0
    assert scores["greedy_logprob_matrix"][0] == [-0.1] * 5


def test_greedy_first_on_full_tie():
    assert greedy_token_selection.decide([[-1.0], [-1.0]])[0] == 0


def test_unconditional_normalization():
    i, scores = unconditional_likelihood_normalized.decide(COND, UNCOND)
    assert scores["normalized_unconditional_prompt_logprobs"] == pytest.approx([0.4, 1.05, -0.04])
    assert i == 1


def test_unconditional_needs_matching_inputs():
    with pytest.raises(InvalidRequestError):
        unconditional_likelihood_normalized.decide(COND, None)
    with pytest.raises(InvalidRequestError):
        unconditional_likelihood_normalized.decide(COND, [[-1.0], [-1.0], [-1.0]])


def test_resolve_method():
    assert resolve_method(None) is token_length_normalized
    assert resolve_method("unconditional_likelihood_normalized") is unconditional_likelihood_normalized
    with pytest.raises(InvalidRequestError, match="unknown choices_method"):
        resolve_method("best")
