"""Strict mode as a schema rewrite (grammar/strict.py), as llguidance serves it: undeclared keys
and extra tuple items refused where that only narrows, never where it could widen the language."""

from __future__ import annotations

import json

import pytest

from deepinfer.grammar import GrammarCompiler, spec_from_params
from deepinfer.grammar import llguidance_backend
from deepinfer.grammar.strict import ADDITIONAL_PROPERTIES, ITEMS, strict_schema

A = {"type": "object", "properties": {"x": {"type": "integer"}}}


def _closed(s: dict) -> dict:
    return {**s, "additionalProperties": False}


@pytest.mark.parametrize("name, schema, expected", [
    ("nested objects", {"type": "object", "properties": {"a": A}}, {"type": "object", "properties": {"a": _closed(A)},
                                                                    "additionalProperties": False}),
    ("tuple", {"type": "array", "prefixItems": [{"type": "integer"}]},
     {"type": "array", "prefixItems": [{"type": "integer"}], "items": False}),
    ("anyOf of whole objects", {"anyOf": [A, {"type": "string"}]}, {"anyOf": [_closed(A), {"type": "string"}]}),
    ("definition reached only from properties", {"$defs": {"A": A}, "type": "object", "properties": {"p": {"$ref": "#/$defs/A"}}},
     {"$defs": {"A": _closed(A)}, "type": "object", "properties": {"p": {"$ref": "#/$defs/A"}}, "additionalProperties": False}),
    ("root ref", {"$ref": "#/definitions/M", "definitions": {"M": A}}, {"$ref": "#/definitions/M", "definitions": {"M": _closed(A)}}),
])
def test_narrows_where_the_subschema_is_the_whole_constraint(name, schema, expected):
    out, done = strict_schema(schema)
    assert out == expected, name
    assert done == sorted({ITEMS} if name == "tuple" else {ADDITIONAL_PROPERTIES})


@pytest.mark.parametrize("name, schema", [
    # under not, a narrower subschema is a wider language: {"x": 1, "y": 2} matches A, so not-A refuses it
    ("not", {"not": A}),
    ("definition also used under not", {"$defs": {"A": A}, "not": {"$ref": "#/$defs/A"}}),
    ("definition referenced by a definition used under not",
     {"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}}, "B": A}, "not": {"$ref": "#/$defs/A"}}),
    # under oneOf, narrowing one branch can make a document that matched two branches match one
    ("oneOf", {"oneOf": [A, {"type": "object", "properties": {"y": {}}}]}),
    # beside the parent's own properties, a closed branch would forbid them
    ("anyOf beside properties", {"type": "object", "properties": {"a": {}}, "anyOf": [A]}),
    ("allOf", {"allOf": [A, {"type": "object", "properties": {"y": {}}}]}),
    ("required key not declared", {"type": "object", "properties": {"a": {}}, "required": ["b"]}),
    ("more keys than declared", {"type": "object", "properties": {"a": {}}, "minProperties": 2}),
    ("more items than the prefix", {"type": "array", "prefixItems": [{}], "minItems": 2}),
    ("ref to the root", {"type": "object", "properties": {"a": {"$ref": "#"}}}),
    ("nested base URI", {"type": "object", "properties": {"a": {"$id": "inner", **A}}}),
    ("an object without properties", {"type": "object"}),
])
def test_leaves_alone_what_it_cannot_narrow_safely(name, schema):
    assert strict_schema(schema) == (schema, []), name


def test_the_data_of_const_and_enum_is_never_touched():
    schema = {"type": "object", "properties": {"a": {"const": {"type": "object", "properties": {"x": 1}}}}}
    out, _ = strict_schema(schema)
    assert out["properties"]["a"] == schema["properties"]["a"]


def _accepts(c: GrammarCompiler, compiled, value) -> bool:
    m = compiled.new_matcher()
    return all(m.accept_token(t) for t in c.tokenizer.encode(json.dumps(value), add_special_tokens=False).ids) \
        and m.can_terminate()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "pos": {"type": "array",
          "prefixItems": [{"type": "integer"}, {"type": "integer"}]}}, "required": ["name"]}


def test_llguidance_strict_refuses_undeclared_keys_and_items_and_stays_exact(llg_compiler, smol):
    compiled, served = llg_compiler.compile(spec_from_params(json_schema=SCHEMA))
    assert served == "llguidance" and compiled.exact and compiled.strict
    assert compiled.narrowed == (ADDITIONAL_PROPERTIES, ITEMS)
    assert _accepts(llg_compiler, compiled, {"name": "a", "pos": [1, 2]})
    assert not _accepts(llg_compiler, compiled, {"name": "a", "other": 1})
    assert not _accepts(llg_compiler, compiled, {"name": "a", "pos": [1, 2, 3]})
    assert not _accepts(llg_compiler, compiled, {"pos": [1, 2]})  # required still enforced
    tok, stops = smol
    lenient = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="llguidance", fallback=False,
                              strict_json=False)
    compiled, _ = lenient.compile(spec_from_params(json_schema=SCHEMA))
    assert not compiled.strict and compiled.narrowed == ()
    assert _accepts(lenient, compiled, {"name": "a", "other": 1}) and _accepts(lenient, compiled, {"name": "a", "pos": [1, 2, 3]})
    # json_object mode means any object: never strict
    compiled, _ = llg_compiler.compile(spec_from_params(json_object=True))
    assert not compiled.strict and _accepts(llg_compiler, compiled, {"any": {"thing": [1]}})


def test_a_narrowing_llguidance_cannot_satisfy_falls_back_to_the_schema_as_given(smol, monkeypatch):
    """Should the rewrite ever leave no instance, the schema compiles as given (not strict), and the
    spec is not refused as unsatisfiable: that would be our narrowing's fault, not the user's."""
    def unsatisfiable(schema):
        return {**schema, "required": ["never-declared"], "additionalProperties": False}, [ADDITIONAL_PROPERTIES]

    monkeypatch.setattr(llguidance_backend, "strict_schema", unsatisfiable)
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="llguidance", fallback=False)
    compiled, served = c.compile(spec_from_params(json_schema=SCHEMA))
    assert served == "llguidance" and compiled.exact and not compiled.strict and compiled.narrowed == ()
    assert _accepts(c, compiled, {"name": "a", "other": 1})


def test_on_the_bench_strict_grammars_accept_a_subset_and_no_invalid_instance(smol, bench_dir):
    """Every bench schema on llguidance, strict and not: what the strict grammar accepts the lenient
    one accepts too (the rewrite only narrows), and an exact strict grammar accepts no invalid instance."""
    from deepinfer.errors import GrammarError
    from deepinfer.grammar.coverage import BENCH_FILES, load_bench_file, schema_spec

    tok, stops = smol
    strict, lenient = (GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="llguidance", fallback=False,
                                       strict_json=s) for s in (True, False))
    narrowed = widened = leaks = 0
    for f in BENCH_FILES:
        for rec in load_bench_file(bench_dir / f):
            try:
                spec = schema_spec(rec["schema"])
                g, _ = strict.compile(spec)
                h, _ = lenient.compile(spec)
            except GrammarError:
                continue
            narrowed += bool(g.narrowed)
            for test in rec.get("tests", []):
                ok = _accepts(strict, g, test["data"])
                widened += ok and not _accepts(lenient, h, test["data"])
                leaks += ok and g.exact and not test["valid"]
            strict._cache.clear()
            lenient._cache.clear()
    # 436 of the 578 schemas llguidance compiles are narrowed (llguidance 1.9.1)
    assert narrowed > 400 and widened == 0 and leaks == 0, (narrowed, widened, leaks)
