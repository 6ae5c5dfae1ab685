"""Small objects in any key order (grammar/orders.py): same valid documents, every order accepted."""

from __future__ import annotations

import itertools
import json

import jsonschema
import pytest

from deepinfer.grammar import spec_from_params
from deepinfer.grammar.orders import MAX_PROPERTIES, any_order

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}, "c": {"type": "boolean"}},
          "required": ["a", "b"]}


def test_rewrite_keeps_the_valid_documents():
    out = any_order(SCHEMA)
    assert len(out["anyOf"]) == 6
    docs = [{}, {"a": "x"}, {"a": "x", "b": 1}, {"a": "x", "b": 1, "c": True}, {"a": 1, "b": 1}, {"a": "x", "b": 1, "d": 0},
            {"b": 2, "a": "y", "c": False}]
    for d in docs:
        assert jsonschema.Draft202012Validator(SCHEMA).is_valid(d) == jsonschema.Draft202012Validator(out).is_valid(d), d


def test_what_is_left_alone():
    big = {"type": "object", "properties": {k: {"type": "integer"} for k in "abcd"}}
    assert any_order(big) is big  # more than MAX_PROPERTIES: the declared order stays
    assert MAX_PROPERTIES == 3
    open_ = {"type": "object", "properties": {"a": {}, "b": {}}, "additionalProperties": {"type": "integer"}}
    assert any_order(open_) is open_
    with_id = {"$id": "http://x/y", "type": "object", "properties": {"a": {}, "b": {}}}
    assert any_order(with_id) is with_id
    data = {"enum": [{"properties": {"a": 1, "b": 2}}]}
    assert any_order(data) is data


@pytest.mark.parametrize("which, backend", [("xgr_compiler", "xgrammar"), ("compiler", "llguidance")])
def test_every_key_order_is_accepted_and_exact(request, which, backend, smol_tok):
    compiler = request.getfixturevalue(which)  # xgrammar alone, and the default chain (llguidance)
    compiled, served = compiler.compile(spec_from_params(json_schema=SCHEMA))
    assert served == backend and compiled.exact

    def accepted(value) -> bool:
        m = compiled.new_matcher()
        ok = all(m.accept_token(t) for t in smol_tok.encode(json.dumps(value), add_special_tokens=False).ids)
        return ok and m.can_terminate()

    full = {"a": "x", "b": 1, "c": True}
    for order in itertools.permutations(full):
        assert accepted({k: full[k] for k in order}), order
    assert accepted({"b": 1, "a": "x"})
    assert not accepted({"a": "x"}) and not accepted({"c": True, "a": "x"})  # b is required
    assert not accepted({"a": "x", "b": "1"})  # property schemas still hold
