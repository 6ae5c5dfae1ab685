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
    **extra: Any,
) -> Gen | Select:
    """Generate into variable `name` (read it back with `s[name]`).

    Parameters left None take the run-level defaults (`f.run(temperature=0, ...)`), then the
    SamplingParams defaults. `json_schema` values decode into the user's type (msgspec.Struct,
    pydantic model, TypedDict, ...) or plain dicts; `dtype` (int/float/bool/str) into that type.
    `choices` makes this a `select` (scored, not sampled), as in SGLang. Other SamplingParams
    fields (e.g. repetition_penalty, ignore_eos) may be passed as keywords.
    """
    _check_name(name)
    if choices is not None:
        return select(name, choices, choices_method=choices_method)
    sampling = dict(
        max_tokens=max_tokens, min_tokens=min_tokens, stop=stop, stop_token_ids=stop_token_ids,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed, regex=regex,
        json_schema=json_schema, grammar=grammar, dtype=dtype, **extra,
    )
    return Gen(name, {k: v for k, v in sampling.items() if v is not None}, bool(return_logprob))


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesMethod | str | None = None,
) -> Select:
    """Pick one of `choices` by the model's likelihood (method: see deepinfer.lang.choices)."""
    _check_name(name)
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(f"select needs a non-empty list of non-empty strings, got {choices!r}")
    return Select(name, list(choices), resolve_method(choices_method))


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
