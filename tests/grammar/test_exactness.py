"""Exactness per compiled grammar, the keyword table per backend, invalid specs refused by every
backend, and validation at finish."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer.errors import GrammarError, InvalidSpecError
from deepinfer.grammar import GrammarCompiler, spec_from_params
from deepinfer.grammar.compiler import BACKEND_NAMES
from deepinfer.grammar.exactness import (
    DRAFT3,
    EXACT_FORMATS,
    EXACT_KEYWORDS,
    FLOAT_BOUND,
    FLOAT_MULTIPLE,
    diagnostics_keywords,
    keywords_used,
)
from deepinfer.grammar.lowering import lower_schema
from deepinfer.grammar.validate import check_output, first_violation

# keyword -> list of (schema, valid instances, invalid instances)
KEYWORD_CASES = {
 "type": ({"type": "integer"}, [3, -7], ["3", 3.5, None]),
 "enum": ({"enum": ["a", 1, None]}, ["a", 1, None], ["b", 2]),
 "const": ({"const": "x"}, ["x"], ["y"]),
 "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}}, [{"a": 1}, {}], [{"a": "s"}]),
 "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, [{"a": 1}], [{}]),
 "additionalProperties": ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}, [{"a": 1, "b": "x"}], [{"a": 1, "b": 2}]),
 "items": ({"type": "array", "items": {"type": "integer"}}, [[1, 2], []], [[1, "a"]]),
 "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False}, [["a", 1]], [[1, "a"], ["a", 1, 2]]),
 "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [[1, 2]], [[1]]),
 "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [[1, 2]], [[1, 2, 3]]),
 "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [[1, 2]], [[1, 1]]),
 "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [[1, 5]], [[1, 2]]),
 "minLength": ({"type": "string", "minLength": 2}, ["ab"], ["a"]),
 "maxLength": ({"type": "string", "maxLength": 2}, ["ab"], ["abc"]),
 "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, ["abc"], ["abd", ""]),
 "format": ({"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567", "x"]),
 "minimum": ({"type": "integer", "minimum": 5}, [5, 99], [4, -1]),
 "maximum": ({"type": "integer", "maximum": 5}, [5, -3], [6, 100]),
 "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 5}, [6], [5]),
 "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 5}, [4], [5]),
 "multipleOf": ({"type": "integer", "multipleOf": 3}, [9, 0], [10]),
 "minProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1}, [{"a": 1}], [{}]),
 "maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1}, [{"a": 1}], [{"a": 1, "b": 2}]),
 "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False}, [{"xa": 1}], [{"xa": "s"}, {"y": 1}]),
 "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": {"type": "integer"}}, [{"ab": 1}], [{"A1": 1}]),
 "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}}, [{"a": 1, "b": 2}, {}], [{"a": 1}]),
 "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]}, [1, "a"], ["ab", None]),
 "oneOf": ({"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}, [-5, 20], [5]),
 "allOf": ({"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}, [5], [-1, 11]),
 "not": ({"type": "integer", "not": {"const": 3}}, [4], [3]),
 "if": ({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}}, [12, 3], [11]),
 "$ref": ({"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}}, [{"a": 1}], [{"a": "x"}]),
 "unevaluatedProperties": ({"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False}, [{"a": 1}], [{"a": 1, "b": 2}]),
}
FORMAT_CASES = {
    "email": (["a@b.co"], ["no-at-sign"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567", "zz"]),
}

UNSATISFIABLE = [
    {"enum": []},
    {"type": "integer", "minimum": 5, "maximum": 1},
    {"type": "integer", "minimum": 5.2, "maximum": 5.8},
    {"type": "string", "minLength": 4, "maxLength": 2},
    {"not": {}},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]},
    {"anyOf": [{"enum": []}, {"type": "array", "minItems": 3, "maxItems": 1}]},
    {"type": "string", "enum": [1, 2]},
    {"type": "integer", "minimum": "5"},  # not a valid JSON Schema
]


@pytest.fixture(scope="module")
def compilers(smol):
    tok, stops = smol
    return {b: GrammarCompiler(tok, tok.get_vocab_size(), stops, backend=b, fallback=False) for b in BACKEND_NAMES}


def accepts(compiler: GrammarCompiler, compiled, value) -> bool:
    m = compiled.new_matcher()
    for t in compiler.tokenizer.encode(json.dumps(value), add_special_tokens=False).ids:
        if not m.accept_token(t):
            return False
    return m.can_terminate()


def test_every_exact_keyword_has_a_case():
    for backend, exact in EXACT_KEYWORDS.items():
        assert exact <= set(KEYWORD_CASES), (backend, sorted(exact - set(KEYWORD_CASES)))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_keyword_table_holds_for_backend(compilers, backend):
    """A grammar reported exact rejects every invalid instance of its keyword's case; a keyword
    outside the backend's table is reported approximated (or refused). The cases' instances are
    checked against jsonschema first, so the table is tested against the standard."""
    c = compilers[backend]
    for kw, (schema, valid, invalid) in KEYWORD_CASES.items():
        for v in valid:
            assert jsonschema.validate(v, schema) is None
        for v in invalid:
            assert first_violation(json.dumps(schema), json.dumps(v)) is not None, (kw, v)
        try:
            compiled, _ = c.compile(spec_from_params(json_schema=schema))
        except GrammarError:
            continue  # refusing is always safe
        if kw in EXACT_KEYWORDS[backend]:
            # exact, unless the backend's own warnings said otherwise (xgrammar: overlapping oneOf)
            assert compiled.exact or (compiled.warnings and kw in compiled.approximated), (backend, kw)
        elif kw in keywords_used(lower_schema(schema)):  # (an exact lowering may remove it)
            assert kw in compiled.approximated, (backend, kw, compiled.approximated)
        if compiled.exact:
            leaked = [v for v in invalid if accepts(c, compiled, v)]
            assert not leaked, f"{backend} reports {kw} exact but accepts invalid {leaked}"


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_exact_formats(compilers, backend):
    c = compilers[backend]
    for fmt, (valid, invalid) in FORMAT_CASES.items():
        assert fmt in EXACT_FORMATS
        compiled, _ = c.compile(spec_from_params(json_schema={"type": "string", "format": fmt}))
        assert compiled.exact
        assert all(accepts(c, compiled, v) for v in valid), fmt
        assert not any(accepts(c, compiled, v) for v in invalid), fmt


def test_unknown_format_is_approximated():
    assert keywords_used({"type": "string", "format": "hostname-ish"}) == {"type", "format:hostname-ish"}
    # the grammars accept 2024-02-30, jsonschema does not
    assert keywords_used({"type": "string", "format": "date"}) == {"type", "format:date"}


def test_required_without_property_schema_is_approximated_by_xgrammar(compilers):
    """xgrammar does not enforce a required name that `properties` does not declare
    (found as exact leaks on JSONSchemaBench Github_easy---o10030)."""
    c = compilers["xgrammar"]
    schema = {"type": "object", "properties": {"host": {"type": "string"}}, "required": ["host", "port"],
              "additionalProperties": {"type": "integer"}}
    compiled, _ = c.compile(spec_from_params(json_schema=schema))
    assert "required" in compiled.approximated
    if accepts(c, compiled, {"host": "h"}):  # the reason it is in the list
        assert first_violation(json.dumps(schema), json.dumps({"host": "h"})) is not None
    # without additionalProperties the lowering declares port (schema {}): then it is enforced exactly
    del schema["additionalProperties"]
    compiled, _ = c.compile(spec_from_params(json_schema=schema))
    assert compiled.exact
    assert accepts(c, compiled, {"host": "h", "port": 1}) and not accepts(c, compiled, {"host": "h"})


def test_xgrammar_warnings_become_approximated_keywords_not_stderr(compilers, capfd):
    c = compilers["xgrammar"]
    cases = {
        "oneOf": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
        "allOf": {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]},
        "minLength": {"type": "string", "pattern": "^[a-z]+$", "minLength": 3},
        "pattern": {"type": "string", "pattern": "^(ab|^c)$"},
    }
    capfd.readouterr()
    for kw, schema in cases.items():
        # the backend itself: the compiler's lowering would merge this allOf into one schema
        compiled = c.get_backend("xgrammar").compile(spec_from_params(json_schema=schema))
        assert compiled.warnings and kw in diagnostics_keywords(compiled.warnings), (kw, compiled.warnings)
    assert "Warning" not in capfd.readouterr().err


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("fallback", [False, True])
def test_unsatisfiable_specs_are_refused_by_every_backend(smol, backend, fallback):
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend=backend, fallback=fallback)
    for schema in UNSATISFIABLE:
        with pytest.raises(InvalidSpecError):
            c.compile(spec_from_params(json_schema=schema))
    with pytest.raises(InvalidSpecError, match="empty"):
        c.compile(spec_from_params(regex=r"[^\s\S]"))
    assert c.stats["invalid_specs"] == len(UNSATISFIABLE) + 1
    assert not any(k.startswith("served_") for k in c.stats)


def test_legitimate_unsatisfiable_subschemas_still_compile(compilers):
    """`not: {}` on an optional property forbids the key; a contradiction inside `not` is fine."""
    c = compilers["xgrammar"]
    forbid = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"not": {}}}, "required": ["a"]}
    compiled, _ = c.compile(spec_from_params(json_schema=forbid))
    assert accepts(c, compiled, {"a": 1})
    inside_not = {"type": "string", "not": {"minLength": 5, "maxLength": 3}}
    c.compile(spec_from_params(json_schema=inside_not))


def test_fallback_picks_the_most_exact_backend(smol):
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops)
    # (a one-atom pattern such as ^[a-z]+$ takes its length bounds itself, patterns.py)
    schema = {"type": "string", "pattern": "^[a-z]+@[a-z]+$", "maxLength": 5}
    compiled, served = c.compile(spec_from_params(json_schema=schema))
    assert served == "llguidance" and compiled.exact
    assert not accepts(c, compiled, "abc@de") and accepts(c, compiled, "ab@cd")
    # outlines first: it ignores integer bounds (5..9 became 100000), so an exact backend serves
    c2 = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="outlines")
    compiled, served = c2.compile(spec_from_params(json_schema={"type": "integer", "minimum": 5, "maximum": 9}))
    assert served != "outlines" and compiled.exact
    assert not accepts(c2, compiled, 100000) and accepts(c2, compiled, 7)
    # nothing exact: the least approximated result is kept (xgrammar ignores uniqueItems, the others refuse it
    # or approximate more)
    compiled, served = c.compile(spec_from_params(json_schema={"type": "array", "items": {"type": "integer"},
                                                               "uniqueItems": True}))
    assert served == "xgrammar" and compiled.approximated == ("uniqueItems",)
    assert c.stats["approximated"] == 1


def test_check_output_validates_approximated_and_incomplete_outputs(compilers):
    c = compilers["xgrammar"]
    approx, _ = c.compile(spec_from_params(json_schema={"type": "array", "items": {"type": "integer"},
                                                          "uniqueItems": True}))
    m = approx.new_matcher()
    valid, why = check_output(approx, m, "[1, 1]", "stop")
    assert valid is False and "non-unique" in why
    assert check_output(approx, m, "[1, 2]", "stop") == (True, None)
    exact, _ = c.compile(spec_from_params(json_schema={"type": "array", "items": {"type": "integer"}}))
    m = exact.new_matcher()
    for t in c.tokenizer.encode("[1", add_special_tokens=False).ids:
        assert m.accept_token(t)
    valid, why = check_output(exact, m, "[1", "length")
    assert valid is False and "not valid JSON" in why
    regex, _ = c.compile(spec_from_params(regex="a+"))
    assert check_output(regex, regex.new_matcher(), "aa", "stop") == (None, None)
    assert check_output(approx, approx.new_matcher(), "[1, 1]", "error") == (None, None)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_strict_mode_narrowing_is_reported_not_approximated(smol, backend):
    """Strict mode refuses undeclared keys and tuple items (JSON Schema allows them): a deliberate
    narrowing, reported in `narrowed`; the grammar stays exact (every accepted output is valid).
    xgrammar has the mode itself; for llguidance it is written into the schema (strict.py)."""
    tok, stops = smol
    open_obj = {"type": "object", "properties": {"a": {"type": "integer"}, "t": {"type": "array",
                "prefixItems": [{"type": "integer"}]}}}
    closed = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False}
    strict = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend=backend, fallback=False)
    compiled, _ = strict.compile(spec_from_params(json_schema=open_obj))
    assert compiled.exact and compiled.strict
    assert compiled.narrowed == ("additionalProperties (strict)", "items (strict)")
    assert not accepts(strict, compiled, {"a": 1, "b": 2})  # the narrowing itself
    assert not accepts(strict, compiled, {"a": 1, "t": [1, 2]})
    assert accepts(strict, compiled, {"a": 1, "t": [1]})
    compiled, _ = strict.compile(spec_from_params(json_schema=closed))
    assert compiled.exact and compiled.narrowed == ()  # additionalProperties set: nothing narrowed
    lenient = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend=backend, fallback=False, strict_json=False)
    compiled, _ = lenient.compile(spec_from_params(json_schema=open_obj))
    assert not compiled.strict and compiled.narrowed == ()  # spec-faithful
    assert accepts(lenient, compiled, {"a": 1, "b": 2}) and accepts(lenient, compiled, {"a": 1, "t": [1, 2]})

# Contexts in which the grammars decide differently from the validator, whatever the backend:
# keywords_used reports them, so no grammar with them is exact. name -> (schema, texts the
# validator refuses; some backend's grammar accepts one of them, which is why they are reported)
CONTEXT_CASES = {
    # draft 3's own keywords and meanings (required: true, divisibleBy, extends, disallow)
    DRAFT3: ({"$schema": "http://json-schema.org/draft-03/schema#", "type": "number", "divisibleBy": 2}, ["3"]),
    # jsonschema divides doubles: 0.3 / 0.1 = 2.9999999999999996, so 0.3 fails; llguidance says it is a multiple
    FLOAT_MULTIPLE: ({"type": "number", "multipleOf": 0.1}, ["0.3", "0.7"]),
    # the validator reads the nearest double (0.1, 1.0): on the bound; the text is strictly inside
    FLOAT_BOUND.format("exclusiveMaximum"): ({"type": "number", "exclusiveMaximum": 0.1}, ["0.09999999999999999999"]),
    FLOAT_BOUND.format("exclusiveMinimum"): ({"type": "number", "exclusiveMinimum": 1}, ["1.00000000000000000001"]),
}


def _accepts_text(compiler: GrammarCompiler, compiled, text: str) -> bool:
    m = compiled.new_matcher()
    for t in compiler.tokenizer.encode(text, add_special_tokens=False).ids:
        if not m.accept_token(t):
            return False
    return m.can_terminate()


@pytest.mark.parametrize("name", sorted(CONTEXT_CASES))
def test_contexts_the_validator_decides_otherwise_are_approximated(compilers, name):
    schema, refused = CONTEXT_CASES[name]
    for text in refused:
        assert first_violation(json.dumps(schema), text) is not None, (name, text)
    assert name in keywords_used(schema)
    accepted_somewhere = False
    for backend, c in compilers.items():
        try:
            compiled, _ = c.compile(spec_from_params(json_schema=schema))
        except GrammarError:
            continue  # refusing is always safe
        assert not compiled.exact and name in compiled.approximated, (backend, name, compiled.approximated)
        accepted_somewhere |= any(_accepts_text(c, compiled, t) for t in refused)
    assert accepted_somewhere, f"no backend accepts {refused} for {name}: the context need not be reported"
    # the integral forms stay exact where the table says so
    assert FLOAT_MULTIPLE not in keywords_used({"type": "number", "multipleOf": 3})
    assert not {k for k in keywords_used({"type": "integer", "exclusiveMaximum": 3}) if "(float)" in k}


def test_xgrammar_siblings_it_drops_are_approximated(compilers):
    """What xgrammar silently drops: keywords beside a $ref (2019-09 on, where they apply) and an
    allOf branch the lowering could not merge. Each was an exact grammar accepting an invalid
    instance; now each is reported, and the draft-07 $ref (siblings ignored by the validator too)
    stays exact."""
    c = compilers["xgrammar"]
    ref = {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n", "maximum": 3}}}
    cases = [
        ("$ref", ref, {"a": 5}),
        ("allOf", {"type": "string", "pattern": "^a", "allOf": [{"pattern": "b$"}]}, "a"),
        ("allOf", {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False,
                   "allOf": [{"properties": {"b": {"type": "integer"}}}]}, {"b": 1}),
    ]
    for kw, schema, bad in cases:
        assert first_violation(json.dumps(schema), json.dumps(bad)) is not None, (kw, bad)
        compiled, _ = c.compile(spec_from_params(json_schema=schema))
        assert kw in compiled.approximated, (kw, compiled.approximated)
        assert accepts(c, compiled, bad), f"xgrammar now enforces {kw} here: it may go back in its table"
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **{k: v for k, v in ref.items() if k != "$defs"},
              "definitions": {"n": {"type": "integer"}}}
    draft7["properties"] = {"a": {"$ref": "#/definitions/n", "maximum": 3}}
    assert first_violation(json.dumps(draft7), json.dumps({"a": 5})) is None  # the sibling is ignored
    compiled, _ = c.compile(spec_from_params(json_schema=draft7))
    assert compiled.exact and accepts(c, compiled, {"a": 5})


def _exact_leaks(compiler: GrammarCompiler, records) -> tuple[int, int, list[str]]:
    """(exact grammars, invalid instances run against them, "id: test i" of each one accepted).
    Instances written as MaskBench writes them (ensure_ascii=False)."""
    from deepinfer.grammar.coverage import schema_spec

    exact = checked = 0
    leaks: list[str] = []
    for n, rec in enumerate(records):
        try:
            compiled, _ = compiler.compile(schema_spec(rec["schema"]))
        except GrammarError:
            continue
        if compiled.exact:
            exact += 1
            for i, test in enumerate(rec.get("tests") or []):
                if not test["valid"]:
                    checked += 1
                    if _accepts_text(compiler, compiled, json.dumps(test["data"], ensure_ascii=False)):
                        leaks.append(f"{rec.get('id', n)}: test {i}")
        compiler._cache.clear()  # one schema's grammar at a time (the 747 hold ~2 GB together)
    return exact, checked, leaks


def _shared_records(bench_dir):
    from deepinfer.grammar.coverage import BENCH_FILES, load_bench_file

    out = []
    for f in BENCH_FILES:
        for i, rec in enumerate(load_bench_file(bench_dir / f)):
            out.append({**rec, "id": f"{f}/{rec.get('id', i)}"})
    return out


@pytest.mark.parametrize("backend", ["auto", "llguidance", "xgrammar"])
def test_no_exact_grammar_accepts_an_invalid_instance_of_the_shared_bench(smol, bench_dir, backend):
    """Every invalid instance of the shared 747 schemas against every grammar that claims exact:
    the default chain's (what requests get) and each fast backend's own."""
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend=backend, fallback=backend == "auto")
    exact, checked, leaks = _exact_leaks(c, _shared_records(bench_dir))
    assert not leaks, f"{backend}: exact grammars accepted invalid instances: {leaks[:20]}"
    assert exact > 300 and checked > 500, (exact, checked)  # the check ran on real grammars


@pytest.mark.slow
def test_no_exact_outlines_grammar_accepts_an_invalid_instance_of_the_shared_bench(smol, bench_dir):
    tok, stops = smol
    c = GrammarCompiler(tok, tok.get_vocab_size(), stops, backend="outlines", fallback=False, compile_timeout=60)
    exact, checked, leaks = _exact_leaks(c, _shared_records(bench_dir))
    assert not leaks, f"outlines: exact grammars accepted invalid instances: {leaks[:20]}"
    assert exact > 100 and checked > 100, (exact, checked)
