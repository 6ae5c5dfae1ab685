"""GrammarSpec construction (spec_from_params) and decode_output."""

from __future__ import annotations

import json
import re
from typing import Literal, Optional, TypedDict

import msgspec
import pytest

from deepinfer.errors import GrammarError
from deepinfer.grammar import GrammarSpec, decode_output, spec_from_params
from deepinfer.grammar.spec import spec_of


class Address(msgspec.Struct):
    city: str
    zip: Optional[str] = None


class Person(msgspec.Struct):
    name: str
    age: int
    address: Address
    tags: list[str] = []


class Movie(TypedDict):
    title: str
    year: int


def test_unconstrained_is_none():
    assert spec_from_params() is None
    assert spec_from_params(json_object=False) is None


def test_kinds():
    assert spec_from_params(regex="a+").kind == "regex"
    assert spec_from_params(grammar='root ::= "x"').kind == "ebnf"
    assert spec_from_params(choices=["a", "b"]).kind == "choices"
    assert spec_from_params(json_object=True).kind == "json_object"
    assert spec_from_params(json_schema={"type": "integer"}).kind == "json_schema"


def test_more_than_one_constraint_is_an_error():
    with pytest.raises(GrammarError, match="regex, choices"):
        spec_from_params(regex="a", choices=["a"])


def test_schema_dict_and_string_give_the_same_spec_and_keep_key_order():
    d = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}
    a = spec_from_params(json_schema=d)
    b = spec_from_params(json_schema=json.dumps(d, indent=2))
    assert a == b and hash(a) == hash(b)
    assert list(json.loads(a.text)["properties"]) == ["z", "a"]  # generation order is the declared order


@pytest.mark.parametrize(
    "bad, problem",
    [("{not json", "not valid JSON"), ("[1, 2]", "expected an object"), (object(), "cannot derive a schema")],
)
def test_bad_schemas_raise(bad, problem):
    with pytest.raises(GrammarError, match="invalid JSON schema") as e:
        spec_from_params(json_schema=bad)
    assert problem in str(e.value)


def test_struct_schema_has_refs_and_decodes_back():
    spec = spec_from_params(json_schema=Person)
    schema = json.loads(spec.text)
    assert "$defs" in schema and "Address" in schema["$defs"]
    p = decode_output(spec, '{"name": "Ann", "age": 3, "address": {"city": "Oslo"}}')
    assert isinstance(p, Person) and isinstance(p.address, Address)
    assert (p.name, p.age, p.address.city, p.address.zip, p.tags) == ("Ann", 3, "Oslo", None, [])


@pytest.mark.parametrize(
    "tp, text, expected",
    [
        (list[int], "[1, 2, 3]", [1, 2, 3]),
        (dict[str, float], '{"a": 1.5}', {"a": 1.5}),
        (Literal["x", "y"], '"y"', "y"),
        (Optional[int], "null", None),
        (Movie, '{"title": "M", "year": 1999}', {"title": "M", "year": 1999}),
    ],
)
def test_type_hints(tp, text, expected):
    spec = spec_from_params(json_schema=tp)
    assert spec.py_type is tp
    assert decode_output(spec, text) == expected


def test_type_hint_schema_contents():
    assert json.loads(spec_from_params(json_schema=list[int]).text) == {"type": "array", "items": {"type": "integer"}}
    assert json.loads(spec_from_params(json_schema=Literal["x", "y"]).text) == {"enum": ["x", "y"]}


def test_decode_rejects_text_of_the_wrong_type():
    with pytest.raises(GrammarError, match="does not decode"):
        decode_output(spec_from_params(json_schema=list[int]), '["a"]')


def test_pydantic_model_if_available():
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        name: str
        price: float

    spec = spec_from_params(json_schema=Item)
    assert json.loads(spec.text)["required"] == ["name", "price"]
    item = decode_output(spec, '{"name": "pen", "price": 1.25}')
    assert isinstance(item, Item) and item.price == 1.25


def test_py_type_is_not_part_of_the_cache_key():
    a = spec_from_params(json_schema=list[int])
    b = GrammarSpec("json_schema", a.text)
    assert a == b and hash(a) == hash(b)


@pytest.mark.parametrize(
    "dtype, good, bad",
    [
        (int, ["0", "-12", "9" * 19], ["01", "-", "1.0", "9" * 20]),
        ("float", ["0", "-1.5", "3e10", "2.25E-3"], ["1.", ".5", "e3", "00.1"]),
        (bool, ["true", "false"], ["True", "1"]),
        (str, ['"hi"', '"a\\"b"', '""'], ["hi", '"a"b"']),
    ],
)
def test_dtype_regexes(dtype, good, bad):
    spec = spec_from_params(dtype=dtype)
    assert spec.kind == "regex"
    for g in good:
        assert re.fullmatch(spec.text, g), g
    for b in bad:
        assert not re.fullmatch(spec.text, b), b


def test_dtype_decoding():
    assert decode_output(spec_from_params(dtype=int), "-42") == -42
    assert decode_output(spec_from_params(dtype="float"), "2.5e1") == 25.0
    assert decode_output(spec_from_params(dtype=bool), "false") is False
    assert decode_output(spec_from_params(dtype=str), '"a\\nb"') == "a\nb"


def test_bad_dtype_and_choices():
    with pytest.raises(GrammarError, match="unsupported dtype"):
        spec_from_params(dtype=complex)
    with pytest.raises(GrammarError, match="invalid choices"):
        spec_from_params(choices=[])
    with pytest.raises(GrammarError, match="invalid choices"):
        spec_from_params(choices="abc")
    with pytest.raises(GrammarError, match="invalid regex"):
        spec_from_params(regex="")
    with pytest.raises(GrammarError, match="invalid EBNF"):
        spec_from_params(grammar="  ")


def test_choices_keep_order_and_dedupe():
    spec = spec_from_params(choices=["b", "a", "b"])
    assert spec.choices == ["b", "a"]
    assert decode_output(spec, "a") == "a"
    with pytest.raises(GrammarError, match="not one of the choices"):
        decode_output(spec, "c")


def test_spec_of_reads_params_objects():
    class Params:
        regex = None
        json_schema = {"type": "integer"}
        grammar = None
        choices = None
        dtype = None
        json_object = False

    assert spec_of(Params()) == spec_from_params(json_schema={"type": "integer"})
    assert decode_output(Params(), "7") == 7
    assert decode_output(spec_from_params(json_object=True), '{"a": [1]}') == {"a": [1]}


def test_schema_keyword_order_and_whitespace_do_not_change_the_spec():
    """The spec (the compiler's cache key) is the schema's canonical form: keywords sorted at every
    level, whitespace dropped; properties keep their declared order and data values their own."""
    a = {"type": "object", "required": ["b", "a"],
         "properties": {"b": {"type": "string", "maxLength": 3}, "a": {"const": {"y": 1, "x": 2}}},
         "$defs": {"z": {"type": "integer"}, "y": {"minimum": 0, "type": "number"}}}
    b = {"$defs": {"y": {"type": "number", "minimum": 0}, "z": {"type": "integer"}},
         "properties": {"b": {"maxLength": 3, "type": "string"}, "a": {"const": {"y": 1, "x": 2}}},
         "required": ["b", "a"], "type": "object"}
    sa, sb = spec_from_params(json_schema=a), spec_from_params(json_schema=b)
    sc = spec_from_params(json_schema=json.dumps(b, indent=3))
    assert sa == sb == sc and hash(sa) == hash(sb) == hash(sc)
    text = json.loads(sa.text)
    assert list(text) == ["$defs", "properties", "required", "type"]
    assert list(text["properties"]) == ["b", "a"] and list(text["properties"]["b"]) == ["maxLength", "type"]
    assert list(text["properties"]["a"]["const"]) == ["y", "x"] and text["required"] == ["b", "a"]
    # another property order is another spec (another grammar: properties are generated in order)
    swapped = {**a, "properties": {"a": a["properties"]["a"], "b": a["properties"]["b"]}}
    assert spec_from_params(json_schema=swapped) != sa
