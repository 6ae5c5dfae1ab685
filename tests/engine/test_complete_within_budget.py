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


def test_budget_guard_is_off_by_default():
    assert SamplingParams().complete_within_budget is False
