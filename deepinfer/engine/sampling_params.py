"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to sample one request. temperature == 0 means greedy.

    Constraint fields (at most one of regex / json_schema / grammar / choices / dtype / json_object)
    are compiled by deepinfer.grammar; json_schema accepts a dict, a JSON string, a msgspec.Struct
    type, a pydantic model type or a Python type hint.
    """

    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: sampled token only; n: plus top-n
    prompt_logprobs: int | None = None  # None: none; 0: each prompt token's logprob; n: plus top-n
    prompt_logprobs_start: int = 0  # prompt positions before this need no logprobs (cache may serve them)
    skip_special_tokens: bool = True
    # constraints
    regex: str | None = None
    json_schema: Any = None
    grammar: str | None = None
    choices: list[str] | None = None
    dtype: Any = None  # int / float / bool / str (or their names)
    json_object: bool = False
    # constrained output only: near max_tokens allow only tokens after which the grammar can still
    # complete in the tokens left (deepinfer.grammar.budget), so the output parses instead of
    # ending half-written with finish_reason="length"
    complete_within_budget: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams: {msg}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise bad(f"max_tokens must be an int >= 0, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if not (self.temperature >= 0.0):
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be an int >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (self.repetition_penalty > 0.0):
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an int or None, got {self.seed!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0 or v > 20):
                raise bad(f"{name} must be None or an int in [0, 20], got {v!r}")
        if not isinstance(self.prompt_logprobs_start, int) or self.prompt_logprobs_start < 0:
            raise bad(f"prompt_logprobs_start must be an int >= 0, got {self.prompt_logprobs_start!r}")
        if self.choices is not None:
            if not isinstance(self.choices, (list, tuple)) or not self.choices or not all(
                isinstance(c, str) and c for c in self.choices
            ):
                raise bad(f"choices must be a non-empty list of non-empty strings, got {self.choices!r}")
            self.choices = list(self.choices)
        n_constraints = sum(
            x is not None and x is not False
            for x in (self.regex, self.json_schema, self.grammar, self.choices, self.dtype, self.json_object or None)
        )
        if n_constraints > 1:
            raise bad("give at most one of regex, json_schema, grammar, choices, dtype, json_object")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constrained(self) -> bool:
        return any(
            x is not None for x in (self.regex, self.json_schema, self.grammar, self.choices, self.dtype)
        ) or self.json_object
