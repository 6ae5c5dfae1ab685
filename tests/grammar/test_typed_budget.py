"""Typed values close in budget (issue 51): the budget guard's closing walk follows JSON strings,
unbounded integers get a digit cap reported as a narrowing, and the bounds of msgspec / pydantic
types are carried into the schema, enforced and decoded back into the type."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Annotated, Literal

import msgspec
import pytest
import torch

from deepinfer.errors import GrammarError
from deepinfer.grammar import allocate_token_bitmask, decode_output, schema_from_type, spec_from_params
from deepinfer.grammar.bitmask import allowed_token_ids
from deepinfer.grammar.budget import JSON_START, lex_json
from deepinfer.grammar.spec import INTEGER_CAP, MAX_INTEGER_DIGITS, cap_integers

pydantic = pytest.importorskip("pydantic")
from pydantic import BaseModel, Field, conint, constr  # noqa: E402


class Person(msgspec.Struct):
    name: str
    age: int


def _lex(compiler, ids):
    state = JSON_START
    for t in ids:
        state = lex_json(state, compiler.token_bytes[t])
    return state


def _accepts(compiler, spec, text: str, tok) -> bool:
    """Whether the grammar takes text whole and can end there."""
    m = compiler.compile(spec)[0].new_matcher()
    return all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False).ids) and m.can_terminate()


# ---- the closing walk ---------------------------------------------------------------------------

def test_lex_json_follows_strings_and_escapes():
    assert lex_json(JSON_START, b'{"a": "x') == (True, False)
    assert lex_json(JSON_START, b'{"a": "x\\') == (True, True)
    assert lex_json(JSON_START, b'{"a": "x\\"y') == (True, False)  # an escaped quote is content
    assert lex_json(JSON_START, b'{"a": "x\\\\"') == (False, False)  # an escaped backslash is not
    assert lex_json(lex_json(JSON_START, b'["a'), b'b", "') == (True, False)


@pytest.mark.parametrize("which", ["llg_compiler", "xgr_compiler"])
def test_closing_path_from_a_value_string_start(request, which, smol_tok):
    """The prefix the issue's failures went through: the old walk took `"}` at `"name":`, which
    opens a string, then `}}` as its content until the limit, found no path and left the mask alone."""
    c = request.getfixturevalue(which)
    spec = spec_from_params(json_schema=Person)
    guard = c.budget_guard()
    for prefix in ('{\n    "name', '{"name": ', '{"name": "Jo', '{"name": "a\\', '{"name": "x", "age": 12'):
        m = c.compile(spec)[0].new_matcher()
        ids = smol_tok.encode(prefix, add_special_tokens=False).ids
        assert all(m.accept_token(t) for t in ids), prefix
        path = guard.closing_path(m, 40, _lex(c, ids))
        assert path is not None, prefix
        assert len(path) <= 16, (prefix, [c.token_bytes[t] for t in path])
        assert all(m.accept_token(t) for t in path) and m.can_terminate()
        value = decode_output(spec, b"".join(c.token_bytes[t] for t in ids + path).decode())
        assert isinstance(value, Person)


def _guarded_run(c, spec, budget: int, seed: int, stop_p: float = 0.3) -> tuple[str, bool]:
    """A 'model' that prefers anything but structure: random logits, punctuation pushed down,
    the stop token drawn only sometimes. Each step's mask goes through the budget guard."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    guard = c.budget_guard()
    m = c.compile(spec)[0].new_matcher()
    mask = allocate_token_bitmask(1, c.vocab_size)
    stops = set(c.vocab.stop_token_ids)
    penalty = torch.zeros(c.vocab_size)
    for i, b in enumerate(c.token_bytes):
        if b and any(ch in b'"{}[],:' for ch in b):
            penalty[i] = -4.0
    out: list[int] = []
    for step in range(budget):
        m.fill_bitmask(mask, 0)
        logits = torch.randn(c.vocab_size, generator=g) + penalty
        guard.restrict(m, mask, 0, logits, budget - step, lambda: _lex(c, out))
        allowed = allowed_token_ids(mask[0], c.vocab_size).tolist()
        assert allowed, "the guard left no token"
        stop_ok = [t for t in allowed if t in stops]
        rest = [t for t in allowed if t not in stops]
        if stop_ok and (not rest or rng.random() < stop_p):
            assert m.accept_token(stop_ok[0])
            return b"".join(c.token_bytes[t] for t in out).decode("utf-8", "replace"), True
        t = max(rest, key=lambda t: float(logits[t]))
        assert m.accept_token(t)
        out.append(t)
    return b"".join(c.token_bytes[t] for t in out).decode("utf-8", "replace"), False


@pytest.mark.parametrize("which", ["llg_compiler", "xgr_compiler"])
def test_guarded_outputs_close_inside_the_budget(request, which):
    c = request.getfixturevalue(which)
    spec = spec_from_params(json_schema=Person, max_integer_digits=MAX_INTEGER_DIGITS)
    for budget in (14, 24, 48):
        for seed in range(4):
            text, ended = _guarded_run(c, spec, budget, seed)
            assert ended, (budget, seed, text)
            assert isinstance(decode_output(spec, text), Person), text


# ---- the integer digit cap ----------------------------------------------------------------------

def test_cap_integers_bounds_only_open_sides_where_that_narrows():
    limit = 10**5 - 1
    s = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0}, "c": {"type": "integer", "maximum": 10**9},
        "d": {"type": "number"}, "e": {"type": "integer", "enum": [1, 10**9]}, "f": {"type": ["integer", "null"]},
        "g": {"type": "array", "items": {"type": "integer", "exclusiveMaximum": 3}},
    }}
    before = json.dumps(s)
    out, hit = cap_integers(s, 5)
    assert hit and json.dumps(s) == before  # the input is left as it was
    p = out["properties"]
    assert p["a"] == {"type": "integer", "minimum": -limit, "maximum": limit}
    assert p["b"] == {"type": "integer", "minimum": 0, "maximum": limit}
    assert p["c"] == s["properties"]["c"]  # a bound past the cap: the user wants big numbers
    assert p["d"] == {"type": "number"} and p["e"] == s["properties"]["e"]
    assert p["f"]["maximum"] == limit and p["g"]["items"] == {"type": "integer", "exclusiveMaximum": 3, "minimum": -limit}
    # under not / oneOf a narrower subschema can let more instances through: left alone
    for widening in ({"not": {"type": "integer"}}, {"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 5}]}):
        assert cap_integers(widening, 5) == (widening, False)
    defs = {"$defs": {"N": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/N"}}}
    assert cap_integers(defs, 5)[0]["$defs"]["N"]["maximum"] == limit
    defs_not = {**defs, "properties": {"x": {"not": {"$ref": "#/$defs/N"}}}}
    assert cap_integers(defs_not, 5) == (defs_not, False)


def test_digit_cap_is_a_reported_narrowing(compiler):
    capped = spec_from_params(json_schema=Person, max_integer_digits=MAX_INTEGER_DIGITS)
    assert capped.narrowed == (INTEGER_CAP,)
    assert INTEGER_CAP in compiler.compile(capped)[0].narrowed
    plain = spec_from_params(json_schema=Person)
    assert plain.narrowed == () and INTEGER_CAP not in compiler.compile(plain)[0].narrowed
    # the same bounds written by the user are no narrowing: another cache entry, nothing reported
    cap = 10**MAX_INTEGER_DIGITS - 1
    written = {"type": "object", "properties": {"age": {"type": "integer", "minimum": -cap, "maximum": cap}}}
    assert spec_from_params(json_schema=written, max_integer_digits=MAX_INTEGER_DIGITS).narrowed == ()
    for bad in (0, MAX_INTEGER_DIGITS + 1, True, "18"):
        with pytest.raises(GrammarError, match="max_integer_digits"):
            spec_from_params(json_schema=Person, max_integer_digits=bad)


@pytest.mark.parametrize("which", ["llg_compiler", "xgr_compiler"])
def test_capped_integer_cannot_be_written_past_its_digits(request, which, smol_tok):
    c = request.getfixturevalue(which)
    capped = spec_from_params(json_schema=Person, max_integer_digits=MAX_INTEGER_DIGITS)
    d = MAX_INTEGER_DIGITS
    assert _accepts(c, capped, '{"name": "a", "age": ' + "9" * d + "}", smol_tok)
    assert _accepts(c, capped, '{"name": "a", "age": -' + "9" * d + "}", smol_tok)
    assert not _accepts(c, capped, '{"name": "a", "age": 1' + "0" * d + "}", smol_tok)
    assert not _accepts(c, capped, '{"name": "a", "age": -1' + "0" * d + "}", smol_tok)
    # lifted: JSON Schema's unbounded integer
    assert _accepts(c, spec_from_params(json_schema=Person), '{"name": "a", "age": 1' + "0" * 30 + "}", smol_tok)


# ---- bounds of typed schemas --------------------------------------------------------------------

class Bounded(msgspec.Struct):
    age: Annotated[int, msgspec.Meta(ge=0, le=130)]
    score: Annotated[float, msgspec.Meta(gt=0, lt=1)]
    code: Annotated[str, msgspec.Meta(min_length=2, max_length=4, pattern="^[A-Z]+$")]
    kind: Literal["a", "b"]
    tags: Annotated[list[Annotated[int, msgspec.Meta(ge=1, le=9)]], msgspec.Meta(max_length=2)]


class PBounded(BaseModel):
    age: int = Field(ge=0, le=130)
    code: str = Field(min_length=2, max_length=4, pattern="^[A-Z]+$")
    kind: Literal["a", "b"]
    n: conint(gt=0, lt=10)
    word: constr(min_length=1, max_length=3)
    x: Annotated[int, Field(ge=5, le=7)]


@dataclasses.dataclass
class DBounded:
    n: Annotated[int, Field(ge=1, le=3)]


def _check_bounded(v) -> None:
    assert 0 <= v.age <= 130 and 2 <= len(v.code) <= 4 and v.code.isupper() and v.kind in ("a", "b")
    if isinstance(v, Bounded):
        assert 0 < v.score < 1 and len(v.tags) <= 2 and all(1 <= t <= 9 for t in v.tags)
    else:
        assert 0 < v.n < 10 and 1 <= len(v.word) <= 3 and 5 <= v.x <= 7


def test_bounds_are_carried_into_the_schema():
    text = json.dumps(schema_from_type(Bounded))
    for kw in ('"minimum": 0', '"maximum": 130', '"exclusiveMinimum": 0', '"exclusiveMaximum": 1', '"minLength": 2',
               '"maxLength": 4', '"pattern": "^[A-Z]+$"', '"enum": ["a", "b"]', '"maxItems": 2', '"minimum": 1'):
        assert kw in text, kw
    text = json.dumps(schema_from_type(PBounded))
    for kw in ('"maximum": 130', '"exclusiveMaximum": 10', '"maxLength": 3', '"minimum": 5', '"pattern": "^[A-Z]+$"'):
        assert kw in text, kw
    # pydantic bounds outside a model: msgspec alone dropped them ({"type": "integer"})
    assert schema_from_type(conint(gt=0)) == {"type": "integer", "exclusiveMinimum": 0}
    assert schema_from_type(list[conint(le=3)])["items"] == {"type": "integer", "maximum": 3}
    assert schema_from_type(DBounded)["properties"]["n"]["maximum"] == 3
    with pytest.raises(GrammarError, match="mixes pydantic constraints"):
        schema_from_type(msgspec.defstruct("Mixed", [("n", conint(gt=0))]))


@pytest.mark.parametrize("tp", [Bounded, PBounded])
def test_bounded_types_generate_only_valid_values(tp, walker):
    spec = spec_from_params(json_schema=tp, max_integer_digits=MAX_INTEGER_DIGITS)
    ended = 0
    for seed in range(10):
        text, done = walker.run(walker.c.compile(spec)[0].new_matcher(), seed)
        if not done:
            continue
        ended += 1
        v = decode_output(spec, text)
        assert isinstance(v, tp), text
        _check_bounded(v)
    assert ended >= 5


def test_a_bound_violation_is_refused(compiler, smol_tok):
    spec = spec_from_params(json_schema=PBounded)
    ok = '{"age": 130, "code": "AB", "kind": "a", "n": 9, "word": "w", "x": 7}'
    assert _accepts(compiler, spec, ok, smol_tok)
    assert isinstance(decode_output(spec, ok), PBounded)
    for bad in (ok.replace("130", "131"), ok.replace('"AB"', '"ABCDE"'), ok.replace('"AB"', '"ab"'),
                ok.replace('"a"', '"c"'), ok.replace('"n": 9', '"n": 10'), ok.replace('"w"', '""'),
                ok.replace('"x": 7', '"x": 4')):
        assert not _accepts(compiler, spec, bad, smol_tok), bad
    lst = spec_from_params(json_schema=list[conint(ge=1, le=9)])
    assert _accepts(compiler, lst, "[1, 9]", smol_tok) and not _accepts(compiler, lst, "[1, 10]", smol_tok)
    assert decode_output(lst, "[1, 9]") == [1, 9]
    with pytest.raises(GrammarError):  # decoding checks the bounds too
        decode_output(lst, "[0]")
    d = spec_from_params(json_schema=DBounded)
    assert decode_output(d, '{"n": 2}') == DBounded(n=2) and not _accepts(compiler, d, '{"n": 4}', smol_tok)
