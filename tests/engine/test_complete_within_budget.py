"""complete_within_budget: nested objects and arrays with a small max_tokens end as valid JSON."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer import Engine, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {
            "type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}}, "required": ["k", "v"]}},
        "meta": {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}},
                 "required": ["a"]},
    },
    "required": ["name", "tags", "meta"],
}


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(str(tiny_models["llama"]), kv_cache_memory=8 << 20, enable_prefix_caching=False)


def _params(max_tokens: int, seed: int, on: bool) -> SamplingParams:
    return SamplingParams(json_schema=SCHEMA, temperature=1.0, seed=seed, max_tokens=max_tokens,
                          complete_within_budget=on)


def test_small_budgets_give_valid_json(engine):
    budgets = [(m, s) for m in (40, 56, 72) for s in range(4)]
    guarded = engine.generate(["x"] * len(budgets), [_params(m, s, True) for m, s in budgets])
    for (m, _), o in zip(budgets, guarded):
        assert o.finish_reason == "stop", (m, o.text)
        assert len(o.token_ids) <= m
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert o.valid is True
    # the same requests without the guard: a random model runs out of tokens half-way
    free = engine.generate(["x"] * len(budgets), [_params(m, s, False) for m, s in budgets])
    assert any(o.finish_reason == "length" for o in free)


def test_budget_guard_is_on_where_the_result_is_typed():
    # typed results (a schema, json_object, a dtype) close inside max_tokens unless told otherwise
    for typed in (dict(json_schema=SCHEMA), dict(json_schema=list[int]), dict(json_object=True), dict(dtype=int)):
        assert SamplingParams(**typed).complete_within_budget is True, typed
        assert SamplingParams(**typed, complete_within_budget=False).complete_within_budget is False, typed
    # text results keep the old default; asked for, the guard still applies to them
    for text in (dict(), dict(regex="a+"), dict(choices=["x", "y"]), dict(grammar='root ::= "a"')):
        assert SamplingParams(**text).complete_within_budget is False, text
    assert SamplingParams(regex="a+", complete_within_budget=True).complete_within_budget is True


def test_typed_request_closes_without_asking(engine):
    """The default now: the same requests as above, complete_within_budget not given."""
    budgets = [(m, s) for m in (40, 56) for s in range(3)]
    outs = engine.generate(["x"] * len(budgets), [SamplingParams(json_schema=SCHEMA, temperature=1.0, seed=s,
                                                                 max_tokens=m) for m, s in budgets])
    for (m, _), o in zip(budgets, outs):
        assert o.finish_reason == "stop" and len(o.token_ids) <= m, (m, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_budget_options_are_checked():
    from deepinfer.errors import InvalidRequestError
    from deepinfer.grammar.spec import MAX_INTEGER_DIGITS

    for bad in (dict(complete_within_budget="yes"), dict(max_integer_digits=0),
                dict(max_integer_digits=MAX_INTEGER_DIGITS + 1), dict(max_integer_digits="5")):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            SamplingParams(json_schema=SCHEMA, **bad)
    assert SamplingParams(json_schema=SCHEMA, max_integer_digits=None).max_integer_digits is None
