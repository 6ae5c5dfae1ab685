"""Validation at finish: RequestOutput.valid / violation / grammar_approximated."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer import Engine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_models):
    return Engine(str(tiny_models["llama"]), kv_cache_memory=8 << 20, enable_prefix_caching=False)


def _valid(schema, text) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_approximated_schema_outputs_are_checked(engine):
    # xgrammar ignores uniqueItems and llguidance/outlines do no better: the grammar is approximated,
    # so a random model writes duplicates that only validation at finish can catch
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
              "minItems": 3, "maxItems": 3, "uniqueItems": True}
    params = [SamplingParams(json_schema=schema, temperature=1.0, seed=i, max_tokens=120) for i in range(12)]
    outs = engine.generate(["list:"] * len(params), params)
    for o in outs:
        assert o.grammar_backend == "xgrammar" and o.grammar_approximated == ["uniqueItems"]
        assert o.valid is _valid(schema, o.text), (o.text, o.valid)
        assert (o.violation is None) is o.valid
    assert any(o.valid is False for o in outs)


def test_exact_schema_outputs_are_valid_and_others_unchecked(engine):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    out = engine.generate(["x"], SamplingParams(json_schema=schema, temperature=1.0, seed=3, max_tokens=120))[0]
    # exact; strict mode's deliberate narrowing (undeclared keys refused) is reported, marked
    assert out.grammar_approximated == ["additionalProperties (strict)"]
    assert out.valid is _valid(schema, out.text)
    if out.finish_reason == "stop":
        assert out.valid is True
    cut = engine.generate(["x"], SamplingParams(json_schema=schema, temperature=1.0, seed=3, max_tokens=2))[0]
    assert cut.finish_reason == "length" and cut.valid is False and "not valid JSON" in cut.violation
    free = engine.generate(["x"], SamplingParams(regex="[ab]{3}", max_tokens=8))[0]
    assert free.valid is None and free.violation is None
