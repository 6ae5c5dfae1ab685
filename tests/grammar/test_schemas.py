"""JSON-schema constrained random walks: every completed output parses and validates."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from deepinfer.grammar import decode_output, spec_from_params

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "owner": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}, "vip": {"type": "boolean"}},
                "required": ["name", "vip"],
            },
        },
        "required": ["id", "owner"],
    },
    "array_bounds": {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}},
        "required": ["xs"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"enum": [1, 2, None]}},
        "required": ["color", "n"],
    },
    "pattern_and_format": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "day": {"type": "string", "format": "date"},
            "mail": {"type": "string", "format": "email"},
        },
        "required": ["code", "day", "mail"],
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "neg": {"type": "integer", "exclusiveMaximum": 0},
        },
        "required": ["age", "score", "neg"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 4}, "b": {"type": "integer"}, "c": {"type": "null"}},
        "required": ["a"],
    },
    "ref": {
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"]}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/pt"}, "end": {"$ref": "#/$defs/pt"}},
        "required": ["start", "end"],
    },
    "anyof": {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5},
                                      {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}]}},
        "required": ["v"],
    },
    "top_level_array": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 5},
}

BACKENDS = [("compiler", "walker"), ("outlines_compiler", "outlines_walker")]
SEEDS = range(5)


def _walk_valid(compiled, walker, schema, seeds=SEEDS):
    outputs = []
    for seed in seeds:
        text, done = walker.run(compiled.new_matcher(), seed, max_steps=600)
        if not done:
            continue  # a long random string; termination is covered by the count below
        value = json.loads(text)
        jsonschema.validate(value, schema)
        outputs.append(value)
    assert len(outputs) >= len(seeds) - 1, "random walks should almost always terminate"
    return outputs


@pytest.mark.parametrize("which, backend", [("xgr_compiler", "xgrammar"), ("compiler", "llguidance")])
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_walks_validate(request, which, backend, name):
    """xgrammar alone, and the default chain (which serves these from llguidance)."""
    compiler, walker = request.getfixturevalue(which), request.getfixturevalue(which.replace("compiler", "walker"))
    schema = SCHEMAS[name]
    compiled, served = compiler.compile(spec_from_params(json_schema=schema))
    assert served == backend and compiled.exact, compiled.approximated
    outs = _walk_valid(compiled, walker, schema)
    assert len({json.dumps(o) for o in outs}) > 1


# outlines' schema-to-regex lacks some features (e.g. exclusive bounds, formats); test what it has
OUTLINES_SCHEMAS = ["nested", "array_bounds", "enum", "optional_fields", "ref", "anyof", "top_level_array"]


@pytest.mark.parametrize("name", OUTLINES_SCHEMAS)
def test_outlines_schema_walks_validate(outlines_compiler, outlines_walker, name):
    schema = SCHEMAS[name]
    compiled, served = outlines_compiler.compile(spec_from_params(json_schema=schema))
    assert served == "outlines"
    _walk_valid(compiled, outlines_walker, schema, seeds=range(3))


class Point(msgspec.Struct):
    x: int
    y: int


class Shape(msgspec.Struct):
    name: str
    points: list[Point]
    closed: bool = False


def test_struct_walk_decodes_to_struct(compiler, walker):
    spec = spec_from_params(json_schema=Shape)
    compiled, _ = compiler.compile(spec)
    schema = json.loads(spec.text)
    decoded = 0
    for seed in SEEDS:
        text, done = walker.run(compiled.new_matcher(), seed, max_steps=600)
        if done:
            jsonschema.validate(json.loads(text), schema)
            shape = decode_output(spec, text)
            assert isinstance(shape, Shape) and all(isinstance(p, Point) for p in shape.points)
            decoded += 1
    assert decoded >= len(SEEDS) - 1


def test_strict_schemas_forbid_undeclared_properties(compiler):
    spec = spec_from_params(json_schema=SCHEMAS["optional_fields"])
    compiled, _ = compiler.compile(spec)
    tok = compiler.tokenizer

    def accepts(text: str) -> bool:
        m = compiled.new_matcher()
        return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False).ids) and m.can_terminate()

    assert accepts('{"a": "hi", "c": null}')
    assert accepts('{"a": "hi"}')
    assert not accepts('{"a": "toolong"}')
    assert not accepts('{"b": 1}')  # "a" is required
    assert not accepts('{"a": "hi", "zz": 1}')  # strict: undeclared property
