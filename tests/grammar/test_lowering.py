"""Exact schema lowerings (grammar/lowering.py): each case is a small schema with valid and
invalid instances. The lowered schema must judge every instance as the original does (checked with
jsonschema), and the grammar compiled from it must accept the valid and reject the invalid ones."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer.errors import InvalidSpecError
from deepinfer.grammar import GrammarCompiler
from deepinfer.grammar.lowering import MAX_ONEOF_VARIANTS, lower_schema
from deepinfer.grammar.spec import spec_from_params

CASES = {
    # allOf branches that only add patternProperties / required / dependencies merge into the parent
    "allOf_pattern_properties": (
        {"type": "object", "allOf": [{"type": "object", "patternProperties": {"a": {"type": "number", "minimum": 10}}},
                                     {"type": "object", "patternProperties": {"b": {"type": "number", "minimum": 3}}}],
         "minProperties": 1},
        [{"a": 15, "b": 5}, {"a": 10}],
        [{"a": 15, "b": 2}, {"a": 9, "b": 5}, {}],
    ),
    "allOf_keeps_parent_limits": (
        {"type": "object", "patternProperties": {"^[a-e]$": True}, "additionalProperties": False,
         "allOf": [{"required": ["a"]}, {"maxProperties": 2}]},
        [{"a": 1}, {"a": 1, "b": 2}],
        [{"a": 1, "f": 2}, {"a": 1, "b": 2, "c": 3}, {"b": 1}],
    ),
    "allOf_bounds_and_required": (
        {"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": False,
         "allOf": [{"properties": {"n": {"minimum": 3}}, "required": ["n"]}, {"properties": {"n": {"maximum": 5}}}]},
        [{"n": 3}, {"n": 5}],
        [{"n": 2}, {"n": 6}, {}, {"n": 4, "m": 1}],
    ),
    # oneOf whose branches only add `required`: distributed and made disjoint
    "oneOf_required_only": (
        {"type": "object", "properties": {"kind": {"type": "string"}, "radius": {"type": "number"},
                                          "length": {"type": "number"}, "width": {"type": "number"}},
         "required": ["kind"], "oneOf": [{"required": ["radius"]}, {"required": ["length", "width"]}]},
        [{"kind": "c", "radius": 1}, {"kind": "r", "length": 2, "width": 3}, {"kind": "r", "radius": 1, "length": 2}],
        [{"kind": "c", "radius": 1, "length": 2, "width": 3}, {"kind": "c"}, {"kind": "c", "length": 1}],
    ),
    # oneOf branches told apart by a required key's enum: distributed, then anyOf
    "oneOf_enum_tagged": (
        {"type": "object", "additionalProperties": False,
         "properties": {"grant": {"type": "string"}, "response": {"type": "string"},
                        "uris": {"type": "array", "items": {"type": "string"}}},
         "oneOf": [{"properties": {"grant": {"enum": ["code"]}, "response": {"enum": ["code"]}}, "required": ["grant"]},
                   {"properties": {"grant": {"enum": ["client"]}, "response": {"enum": ["token"]}},
                    "required": ["grant"]}]},
        [{"grant": "code", "response": "code", "uris": ["x"]}, {"grant": "client", "uris": []}],
        [{"grant": "code", "response": "token"}, {"grant": "code", "uris": [1]}, {"grant": "other"},
         {"uris": []}, {"grant": "code", "extra": 1}],
    ),
    # const next to other keywords: only the const value can validate
    "const_with_other_keywords": (
        {"type": "object", "maxProperties": 2, "propertyNames": {"pattern": "^[0-9]$"},
         "const": {"1": [1, 2], "2": [3]}},
        [{"1": [1, 2], "2": [3]}],
        [{"1": [1, 2]}, {"1": [1], "2": [3]}, {"1": [1, 2], "2": [3], "3": []}],
    ),
    "enum_filtered_by_siblings": (
        {"type": "integer", "minimum": 2, "enum": [1, 2, 3, "x"]},
        [2, 3],
        [1, "x", 4],
    ),
    # object/array enum values spelled any way JSON allows (xgrammar matched its compact spelling only)
    "enum_of_objects": (
        {"enum": [{"a": 1}, [1, {}], "x"]},
        [{"a": 1}, [1, {}], "x"],
        [{"a": 2}, {"a": 1, "b": 1}, [1], "y"],
    ),
}


@pytest.fixture(scope="module")
def compiler(smol):
    tok, stops = smol
    return GrammarCompiler(tok, tok.get_vocab_size(), stops)  # the defaults: xgrammar first, fallback


def _accepts(compiler, compiled, value) -> bool:
    m = compiled.new_matcher()
    for t in compiler.tokenizer.encode(json.dumps(value), add_special_tokens=False).ids:
        if not m.accept_token(t):
            return False
    return m.can_terminate()


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowering_is_equivalent(name):
    schema, valid, invalid = CASES[name]
    low = lower_schema(schema)
    assert low is not schema and low != schema, "the case must exercise a rewrite"
    for v in valid:
        assert jsonschema.Draft202012Validator(schema).is_valid(v), (name, v)
        assert jsonschema.Draft202012Validator(low).is_valid(v), (name, v, low)
    for v in invalid:
        assert not jsonschema.Draft202012Validator(schema).is_valid(v), (name, v)
        assert not jsonschema.Draft202012Validator(low).is_valid(v), (name, v, low)


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowered_grammar_is_exact_and_accepts_exactly(compiler, name):
    schema, valid, invalid = CASES[name]
    compiled, served = compiler.compile(spec_from_params(json_schema=schema))
    assert compiled.exact, (name, served, compiled.approximated)
    assert [v for v in valid if not _accepts(compiler, compiled, v)] == [], (name, served)
    assert [v for v in invalid if _accepts(compiler, compiled, v)] == [], (name, served)


def test_lowering_leaves_what_it_cannot_prove():
    # additionalProperties of the parent and a branch declaring another key: not merged
    s = {"type": "object", "properties": {"a": {}}, "additionalProperties": False,
         "allOf": [{"properties": {"b": {"type": "string"}}}]}
    assert lower_schema(s)["allOf"] == s["allOf"]
    # two different patterns cannot become one exactly
    s = {"type": "string", "pattern": "a", "allOf": [{"pattern": "b"}]}
    assert lower_schema(s) == s
    # refs outside the definitions: nothing moves
    s = {"allOf": [{"$ref": "#/properties/x"}, {"required": ["x"]}], "properties": {"x": {}}}
    assert lower_schema(s) is s
    # oneOf branches with keywords beyond required/properties/type stay oneOf
    s = {"type": "object", "oneOf": [{"required": ["a"], "minProperties": 2}, {"required": ["b"]}]}
    assert "oneOf" in lower_schema(s)


def test_oneof_variants_are_bounded():
    keys = [f"k{i}" for i in range(12)]
    s = {"type": "object", "properties": {k: {} for k in keys},
         "oneOf": [{"required": keys[i:i + 3]} for i in range(0, 12, 3)]}
    assert 3 ** 3 * 4 > MAX_ONEOF_VARIANTS
    assert "oneOf" in lower_schema(s)


def test_const_that_fails_its_siblings_is_an_invalid_spec(compiler):
    s = {"type": "object", "maxProperties": 1, "const": {"a": 1, "b": 2}}
    with pytest.raises(InvalidSpecError, match="const"):
        lower_schema(s)
    with pytest.raises(InvalidSpecError):
        compiler.compile(spec_from_params(json_schema=s))


def test_false_pattern_property_compiles_as_approximated(smol):
    """xgrammar refuses a `false` pattern-property schema; written `{"not": {}}` it compiles and the
    grammar says it approximates (validation at finish then checks the output)."""
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="xgrammar", fallback=False)
    s = {"type": "object", "patternProperties": {"^x": False}, "minProperties": 1}
    compiled, _ = c.compile(spec_from_params(json_schema=s))
    assert not compiled.exact
    # the default chain serves it exactly from llguidance, which enforces the `false` schema
    d = GrammarCompiler(tok, tok.get_vocab_size(), stops)
    compiled, served = d.compile(spec_from_params(json_schema=s))
    assert served == "llguidance" and compiled.exact
    assert not _accepts(d, compiled, {"xa": 1}) and not _accepts(d, compiled, {}) and _accepts(d, compiled, {"b": 1})


def test_false_property_in_lenient_xgrammar_is_reported(smol):
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="xgrammar", fallback=False, strict_json=False)
    compiled, _ = c.compile(spec_from_params(json_schema={"type": "object", "properties": {"a": False, "b": {}}}))
    assert not compiled.exact  # the key a is allowed by the non-strict grammar
    # llguidance (the default chain's first) enforces `false` itself: exact, a refused, others allowed
    d = GrammarCompiler(tok, tok.get_vocab_size(), stops, strict_json=False)
    compiled, served = d.compile(spec_from_params(json_schema={"type": "object", "properties": {"a": False, "b": {}}}))
    assert served == "llguidance" and compiled.exact
    assert not _accepts(d, compiled, {"a": 1}) and _accepts(d, compiled, {"c": 1})
    strict = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="xgrammar", fallback=False)
    compiled, _ = strict.compile(spec_from_params(json_schema={"type": "object", "properties": {"a": False, "b": {}}}))
    assert compiled.exact and not _accepts(strict, compiled, {"a": 1})
