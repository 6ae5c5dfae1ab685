"""Expression constructors of the language: gen, select and the chat roles."""

from __future__ import annotations

from typing import Any

from deepinfer.errors import InvalidRequestError
from deepinfer.lang.choices import ChoicesMethod, resolve_method
from deepinfer.lang.ir import Gen, RoleBegin, RoleEnd, Select, Seq, as_expr


def _check_name(name: Any) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise InvalidRequestError(f"a variable name must be a non-empty str or None, got {name!r}")


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    grammar: str | None = None,
    choices: list[str] | None = None,
    dtype: Any = None,
    return_logprob: bool = False,
    choices_method: ChoicesMethod | str | None = None,
    n: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool = False,
    logprob_start_len: int | None = None,
    **extra: Any,
) -> Gen | Select:
    """Generate into variable `name` (read it back with `s[name]`).

    Parameters left None take the run-level defaults (`f.run(temperature=0, ...)`), then the
    SamplingParams defaults. `json_schema` values decode into the user's type (msgspec.Struct,
    pydantic model, TypedDict, ...) or plain dicts; `dtype` (int/float/bool/str) into that type.
    `choices` makes this a `select` (scored, not sampled), as in SGLang. Other SamplingParams
    fields (e.g. repetition_penalty, ignore_eos) may be passed as keywords.

    SGLang names: `n` samples n continuations of the same prompt (the variable becomes the list
    of their values; the state's text is left as before the gen); `top_logprobs_num` = logprobs
    with that many alternatives (implies return_logprob); `return_text_in_logprobs` adds each
    token's text to the meta info; `logprob_start_len` also returns the prompt's logprobs from
    that token on (meta "input_token_logprobs").
    """
    _check_name(name)
    if choices is not None:
        return select(name, choices, choices_method=choices_method)
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise InvalidRequestError(f"gen n must be an int >= 1, got {n!r}")
    if top_logprobs_num is not None:
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise InvalidRequestError(f"top_logprobs_num must be an int >= 0, got {top_logprobs_num!r}")
        return_logprob = True
        extra["logprobs"] = top_logprobs_num
    if logprob_start_len is not None:
        if not isinstance(logprob_start_len, int) or logprob_start_len < 0:
            raise InvalidRequestError(f"logprob_start_len must be an int >= 0, got {logprob_start_len!r}")
        return_logprob = True
        extra["prompt_logprobs"] = top_logprobs_num or 0
        extra["prompt_logprobs_start"] = logprob_start_len
    if return_text_in_logprobs:
        return_logprob = True
    sampling = dict(
        max_tokens=max_tokens, min_tokens=min_tokens, stop=stop, stop_token_ids=stop_token_ids,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, regex=regex,
        json_schema=json_schema, grammar=grammar, dtype=dtype,
    )
    # the named arguments' None means "not given"; a keyword passed through is kept as given, so
    # gen(..., max_integer_digits=None) lifts the digit cap instead of falling back to its default
    sampling = {**{k: v for k, v in sampling.items() if v is not None}, **extra}
    return Gen(name, sampling, bool(return_logprob),
               n=n, logprob_text=bool(return_text_in_logprobs))


def gen_int(name: str | None = None, **kwargs: Any) -> Gen:
    """SGLang's gen_int: a gen constrained to an integer (`s[name]` is an int)."""
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Gen:
    """SGLang's gen_string: a gen constrained to a JSON string literal (`s[name]` is the str)."""
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod | str | None = None,
    seed: int | None = None,
) -> Select:
    """Pick one of `choices` by the model's likelihood (method: see deepinfer.lang.choices).

    temperature 0 picks the best-scored choice; above 0 a choice is drawn with probabilities
    softmax(score / temperature) over the method's scores, from `seed` (the same seed, scores and
    temperature always draw the same choice; None draws from the OS's randomness).
    """
    _check_name(name)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature >= 0 \
            or temperature == float("inf"):
        raise InvalidRequestError(f"select temperature must be a finite number >= 0, got {temperature!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise InvalidRequestError(f"select seed must be an int or None, got {seed!r}")
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(f"select needs a non-empty list of non-empty strings, got {choices!r}")
    return Select(name, list(choices), resolve_method(choices_method), float(temperature), seed)


def _role(role: str, expr: Any) -> Seq:
    if expr is None:
        return Seq([RoleBegin(role), RoleEnd(role)])
    return Seq([RoleBegin(role), as_expr(expr), RoleEnd(role)])


def system(expr: Any = None) -> Seq:
    """A whole system turn: `s += di.system("You are ...")`."""
    return _role("system", expr)


def user(expr: Any = None) -> Seq:
    """A whole user turn."""
    return _role("user", expr)


def assistant(expr: Any = None) -> Seq:
    """A whole assistant turn, typically `di.assistant(di.gen("answer"))`."""
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")
