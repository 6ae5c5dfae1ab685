"""format: date is lowered to an exact pattern: what jsonschema accepts, and only that, in every backend."""

from __future__ import annotations

import re

import jsonschema
import pytest

from deepinfer.grammar import spec_from_params
from deepinfer.grammar.compiler import BACKEND_NAMES
from deepinfer.grammar.formats import DATE_PATTERN, lower_formats

from test_exactness import accepts, compilers  # noqa: F401  (fixture)

CHECKER = jsonschema.FormatChecker()


def _jsonschema_date(s: str) -> bool:
    return CHECKER.conforms(s, "date")


def test_pattern_equals_jsonschema_date_on_every_day_of_sample_years():
    rx = re.compile(DATE_PATTERN)
    years = ["0000", "0001", "0004", "0100", "0400", "1900", "2000", "2023", "2024", "2100", "9996", "9999"]
    checked = 0
    for y in years:
        for m in range(0, 14):
            for d in range(0, 33):
                s = f"{y}-{m:02d}-{d:02d}"
                assert bool(rx.search(s)) == _jsonschema_date(s), s
                checked += 1
    assert checked == len(years) * 14 * 33
    for s in ["2024-2-01", "2024-02-1", "20240201", "2024-02-01T00:00", " 2024-02-01", "２０２４-02-01", "2024/02/01"]:
        assert not rx.search(s) and not _jsonschema_date(s), s


def test_lowering_rewrites_only_what_it_can_keep_exact():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "format": "date"},
        "b": {"type": "string", "format": "date", "maxLength": 10},  # a pattern and a length: left
        "c": {"type": "string", "format": "email"},
        "d": {"type": "array", "items": {"format": "date"}}}}
    low = lower_formats(schema)
    assert low["properties"]["a"] == {"type": "string", "pattern": DATE_PATTERN}
    assert low["properties"]["b"] == schema["properties"]["b"]
    assert low["properties"]["c"] == schema["properties"]["c"]
    assert low["properties"]["d"]["items"] == {"pattern": DATE_PATTERN}
    assert schema["properties"]["a"]["format"] == "date"  # the input is not modified
    plain = {"type": "string"}
    assert lower_formats(plain) is plain


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_date_is_exact_in_every_backend(compilers, backend):  # noqa: F811
    c = compilers[backend]
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]}
    compiled, _ = c.compile(spec_from_params(json_schema=schema))
    assert "format:date" not in compiled.approximated
    assert compiled.spec == spec_from_params(json_schema=schema)  # validation at finish sees the user's schema
    for day, ok in [("2024-02-29", True), ("2000-02-29", True), ("2023-12-31", True), ("2024-02-30", False),
                    ("2023-02-29", False), ("1900-02-29", False), ("2024-04-31", False), ("0000-01-01", False)]:
        assert accepts(c, compiled, {"when": day}) is ok, (backend, day)
        assert _jsonschema_date(day) is ok
