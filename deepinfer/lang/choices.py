"""How `select` picks a choice from the model's logprobs of each choice's tokens.

Each method gets, per choice, the conditional logprobs of the choice's tokens given the program's
prompt (`cond[i][j]`: token j of choice i) and, when `needs_unconditional`, the same tokens'
logprobs without the prompt (`uncond`). Methods return the index of the winner (first on ties)
and the scores they computed, which end up in `state.get_meta_info(name)`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from deepinfer.errors import InvalidRequestError


def _argmax(values: Sequence[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


class ChoicesMethod:
    """Base class: subclass and implement `decide`."""

    name = "base"
    needs_unconditional = False
    score_key = "normalized_prompt_logprobs"  # the scores a temperature > 0 draw samples from

    def decide(
        self, cond: list[list[float]], uncond: list[list[float]] | None = None
    ) -> tuple[int, dict[str, Any]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<choices method {self.name}>"


class TokenLengthNormalized(ChoicesMethod):
    """Highest mean logprob over the choice's tokens (the default)."""

    name = "token_length_normalized"

    def decide(self, cond, uncond=None):
        scores = [_mean(c) for c in cond]
        return _argmax(scores), {"normalized_prompt_logprobs": scores}


class GreedyTokenSelection(ChoicesMethod):
    """Compare choices token by token, keeping those with the best logprob at each position.

    A choice shorter than the longest is padded with its own mean logprob, so a prefix choice
    ("organ" vs "organism") still competes at later positions.
    """

    name = "greedy_token_selection"

    def decide(self, cond, uncond=None):
        width = max(len(c) for c in cond)
        matrix = [list(c) + [_mean(c)] * (width - len(c)) for c in cond]
        alive = list(range(len(cond)))
        for j in range(width):
            best = max(matrix[i][j] for i in alive)
            alive = [i for i in alive if matrix[i][j] == best]
            if len(alive) == 1:
                break
        return alive[0], {
            "normalized_prompt_logprobs": [_mean(c) for c in cond],
            "greedy_logprob_matrix": matrix,
        }


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    """Highest mean of (conditional - unconditional) logprob per token.

    Corrects for choices the model likes regardless of the question. The first unconditional
    logprob has no context when there is no BOS; it counts as 0 then.
    """

    name = "unconditional_likelihood_normalized"
    needs_unconditional = True
    score_key = "normalized_unconditional_prompt_logprobs"

    def decide(self, cond, uncond=None):
        if uncond is None or len(uncond) != len(cond):
            raise InvalidRequestError("unconditional_likelihood_normalized needs the unconditional logprobs")
        scores = []
        for c, u in zip(cond, uncond):
            if len(c) != len(u):
                raise InvalidRequestError("conditional and unconditional logprobs differ in length")
            scores.append(_mean([a - b for a, b in zip(c, u)]))
        return _argmax(scores), {
            "normalized_prompt_logprobs": [_mean(c) for c in cond],
            "unconditional_token_logprobs": uncond,
            "normalized_unconditional_prompt_logprobs": scores,
        }


def sample_choice(scores: Sequence[float], temperature: float, seed: int | None) -> tuple[int, list[float]]:
    """Draw an index with probabilities softmax(scores / temperature) (inverse CDF in choice order
    from one uniform: hash32(seed) / 2^32, or the OS's randomness without a seed); and the probs."""
    import random

    from deepinfer_kernels import rng

    top = max(scores)
    weights = [math.exp((s - top) / temperature) if s != float("-inf") else 0.0 for s in scores]
    total = sum(weights)
    probs = [w / total for w in weights]
    u = rng.hash32(seed) / 2**32 if seed is not None else random.SystemRandom().random()
    acc = 0.0
    for i, p in enumerate(probs):
        acc += p
        if u < acc:
            return i, probs
    return max(i for i, p in enumerate(probs) if p > 0), probs  # u within rounding of 1


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

_BY_NAME = {m.name: m for m in (token_length_normalized, greedy_token_selection, unconditional_likelihood_normalized)}


def resolve_method(method: Any) -> ChoicesMethod:
    """Accept a ChoicesMethod instance or its name; anything else is a typed error."""
    if method is None:
        return token_length_normalized
    if isinstance(method, ChoicesMethod):
        return method
    if isinstance(method, str) and method in _BY_NAME:
        return _BY_NAME[method]
    raise InvalidRequestError(f"unknown choices_method {method!r}; use one of {sorted(_BY_NAME)}")
