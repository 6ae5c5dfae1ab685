"""Requests in: prompts to token ids, and new Sequences with their seed, grammar matcher and
detokenizer. Bad input raises a typed error here, before anything is queued."""

from __future__ import annotations

import itertools

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.structured_output import StructuredOutputs
from deepinfer.errors import InvalidRequestError
from deepinfer_kernels import rng

PromptType = str | list[int] | list[dict]


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, seed: int, structured: StructuredOutputs):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.seed = seed
        self.structured = structured
        self._arrival = itertools.count()

    def next_arrival(self) -> int:
        return next(self._arrival)

    def encode_prompt(self, prompt: PromptType) -> list[int]:
        """Token ids of a prompt given as text, token ids, or chat messages (rendered by the chat template)."""
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequestError("prompt is empty")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidRequestError("a token-id prompt must be a list of ints")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
            ids = list(prompt)
        else:
            raise InvalidRequestError(
                f"prompt must be a string, a list of token ids or a list of chat messages, got {type(prompt).__name__}"
            )
        if not ids:
            raise InvalidRequestError("prompt is empty after tokenisation")
        return ids

    def new_sequence(
        self, request_id: str | None, ids: list[int], params: SamplingParams, fork_of: str | None = None,
        grammar_wait: float | None = None, adopt_precompile: bool = False,
    ) -> Sequence:
        """A Sequence with its seed, grammar matcher, detokenizer and logprob lists (not yet queued).
        A fork child (request_id None) is named after its parent and its unique arrival number.
        grammar_wait: how long to wait for a grammar not compiled yet (StructuredOutputs.attach);
        past it the sequence comes back with `grammar_pending` set; with adopt_precompile, at once
        when a precompile of its constraint is still running (StructuredOutputs.attach)."""
        from deepinfer.engine.tokenizer import IncrementalDetokenizer

        arrival = self.next_arrival()
        if request_id is None:
            request_id = f"{fork_of}.fork-{arrival}"
        seed = params.seed if params.seed is not None else rng.hash32(self.seed ^ rng.hash32(arrival))
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params, arrival=arrival, rng_seed=seed)
        if params.constrained:
            # raises GrammarError for an invalid spec
            self.structured.attach(seq, params, wait=grammar_wait, adopt_precompile=adopt_precompile)
        seq.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * len(ids)
        return seq
