"""An invalid structured value (RequestOutput.valid is False) is the program's error, never data."""

from __future__ import annotations

import json

import deepinfer.lang as di
from deepinfer.errors import ProgramError
from deepinfer.lang.testing import FakeEngine

SCHEMA = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}, "required": ["age"]}


def _program():
    @di.function
    def extract(s):
        s += di.user("How old?")
        s += di.assistant(di.gen("person", json_schema=SCHEMA, max_tokens=32))

    return extract


def test_invalid_value_is_the_states_error():
    eng = FakeEngine(respond=lambda prompt, params: json.dumps({"age": -4}))  # parses, violates minimum
    st = _program().run(backend=eng)
    assert not st.ok
    err = st.error()
    assert isinstance(err, ProgramError) and "person" in str(err) and "minimum" in str(err)
    assert "person" not in st


def test_valid_value_is_data_with_its_validation_meta():
    eng = FakeEngine(respond=lambda prompt, params: json.dumps({"age": 4}))
    st = _program().run(backend=eng)
    assert st.ok, st.error()
    assert st["person"] == {"age": 4}
    assert st.get_meta_info("person")["valid"] is True
