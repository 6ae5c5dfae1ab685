"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any

from deepinfer.errors import InvalidRequestError, UnknownParameterError
from deepinfer.grammar.spec import MAX_INTEGER_DIGITS


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
    # stop when the output text matches any of these regexes (Python `re`); the output ends where
    # the first match ends (the matched text is kept: what was streamed before stays valid)
    stop_regex: list[str] | str | None = None
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
    # ending half-written with finish_reason="length". None (the default): on where the result is
    # a typed value (json_schema, json_object, dtype), off otherwise; resolved to a bool at
    # construction. Off, 20 of 200 typed {name: str, age: int} gens at max_tokens=48 on SmolLM2-135M
    # ended half-written (issue 51).
    complete_within_budget: bool | None = None
    # json_schema only: an integer with no bound on a side gets one there, |n| < 10**digits
    # (deepinfer.grammar.spec.cap_integers), listed in RequestOutput.grammar_approximated as
    # "integer digits (max_integer_digits)" (a narrowing: outputs stay valid). 1 to 15 (the most
    # llguidance keeps exact); None lifts the cap (integers unbounded, as JSON Schema has them)
    max_integer_digits: int | None = MAX_INTEGER_DIGITS

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        self.stop_regex = list(self.stop_regex or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._check()

    def _check_types(self) -> None:
        """Types first, strictly: a str where a number belongs, or True as max_tokens, is a
        caller's mistake to report, not a value to coerce. Numbers are normalised to int/float."""

        def bad(name: str, want: str, v: Any) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams: {name} must be {want}, got {v!r} ({type(v).__name__})")

        def is_int(v: Any) -> bool:  # bool is an int subclass in Python, never a count here
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is None and name in _OPTIONAL:
                continue
            if not is_int(v):
                raise bad(name, "an int" + (" or None" if name in _OPTIONAL else ""), v)
            setattr(self, name, int(v))
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
                raise bad(name, "a finite number", v)
            setattr(self, name, float(v))
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if v is None and name in _OPTIONAL:
                continue
            if not isinstance(v, bool):
                raise bad(name, "True or False" + (" (or None)" if name in _OPTIONAL else ""), v)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise bad(name, "a string or None", v)
        # stop: a string or a list of strings; a dict or set would silently become its keys
        if self.stop is not None and not isinstance(self.stop, str):
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) for x in self.stop):
                raise bad("stop", "a string or a list of strings", self.stop)
        if self.stop_regex is not None and not isinstance(self.stop_regex, str):
            if not isinstance(self.stop_regex, (list, tuple)) or not all(isinstance(x, str) for x in self.stop_regex):
                raise bad("stop_regex", "a string or a list of strings", self.stop_regex)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(is_int(t) for t in self.stop_token_ids):
                raise bad("stop_token_ids", "a list of ints", self.stop_token_ids)
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.choices is not None and not isinstance(self.choices, (list, tuple)):
            raise bad("choices", "a list of strings", self.choices)

    def _check(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams: {msg}")

        if self.max_tokens < 0:
            raise bad(f"max_tokens must be an int >= 0, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        if not (self.temperature >= 0.0):
            raise bad(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise bad(f"top_k must be an int >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not (0.0 <= self.min_p <= 1.0):
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (self.repetition_penalty > 0.0):
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not (-2.0 <= self.frequency_penalty <= 2.0):
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        if not (-2.0 <= self.presence_penalty <= 2.0):
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        if any(s == "" for s in self.stop):
            raise bad(f"stop strings must be non-empty strings, got {self.stop!r}")
        for pattern in self.stop_regex:
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise bad(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
            if compiled.fullmatch(""):
                raise bad(f"stop_regex {pattern!r} matches the empty string, so it would stop before any output")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                raise bad(f"{name} must be None or an int in [0, 20], got {v!r}")
        if self.max_integer_digits is not None and not 1 <= self.max_integer_digits <= MAX_INTEGER_DIGITS:
            raise bad(f"max_integer_digits must be None or an int in [1, {MAX_INTEGER_DIGITS}] (llguidance "
                      f"reads wider integer bounds inexactly), got {self.max_integer_digits!r}")
        if self.prompt_logprobs_start < 0:
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
        if self.complete_within_budget is None:  # typed results close inside max_tokens by default
            self.complete_within_budget = self.typed

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def typed(self) -> bool:
        """Whether the output decodes into a value (a JSON schema or object, a dtype), not text."""
        return self.json_schema is not None or self.dtype is not None or self.json_object

    @property
    def constrained(self) -> bool:
        return any(
            x is not None for x in (self.regex, self.json_schema, self.grammar, self.choices, self.dtype)
        ) or self.json_object


_INT_FIELDS = ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "prompt_logprobs_start",
               "max_integer_digits")
_OPTIONAL = ("seed", "logprobs", "prompt_logprobs", "complete_within_budget", "max_integer_digits")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
# complete_within_budget too: the string "no" is truthy and would turn the budget guard on
_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "json_object",
                "complete_within_budget")


# ---- unknown fields -------------------------------------------------------------------------
# The dataclass __init__ answers SamplingParams(n=2) with a bare TypeError, while every bad value
# is an InvalidRequestError naming its field; request dicts reach here as **kwargs, so an unknown
# key is a caller's mistake like any other. The wrapper costs nothing on the good path: the names
# are checked only after the generated __init__ has refused the call.
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))
# names that other APIs give to something this project spells or places differently
_FIELD_HINTS = {
    "n": "one request is one sample; for k samples use gen(..., n=k) in a program, \"n\" in an OpenAI "
         "batch request body, or submit the prompt k times with different seeds",
}


def _unknown_fields_error(kwargs: dict[str, Any]) -> UnknownParameterError | None:
    unknown = [k for k in kwargs if k not in _FIELD_NAMES]
    if not unknown:
        return None
    parts = []
    for k in unknown:
        hint = _FIELD_HINTS.get(k)
        if hint is None:
            close = difflib.get_close_matches(k, _FIELD_NAMES, n=1)
            hint = f"did you mean {close[0]!r}?" if close else None
        parts.append(f"unknown field {k!r}" + (f" ({hint})" if hint else ""))
    return UnknownParameterError("SamplingParams: " + "; ".join(parts))


_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)  # keeps the generated signature for inspect and editors
def _init(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    try:
        _dataclass_init(self, *args, **kwargs)
    except TypeError:
        err = _unknown_fields_error(kwargs)
        if err is None:  # not an unknown keyword (too many positionals, a TypeError in a check)
            raise
        raise err from None


SamplingParams.__init__ = _init  # type: ignore[method-assign]
