"""Exact pattern rewrites (grammar/patterns.py): same valid strings, served exactly by xgrammar."""

from __future__ import annotations

import random
import re

import pytest

from deepinfer.grammar import spec_from_params
from deepinfer.grammar.patterns import fold_lengths, hoist_anchors, lower_patterns

HEX = r"[0-9a-fA-F]"
CASES = [  # (pattern, minLength, maxLength)
    (r"^$|(^(?:\S+\s+){0,9}\S+$)", None, None),
    (r"^$|^\+?([\d\s()-]){3,6}$", None, None),
    (r"^[ !\"#$%&\'()*+,\-./0-9:;<=>?@A-Z\[\\\]\^_`a-z{\|}]+$", 5, 5),
    (r"^[a-f ]+$", 3, None),
    (HEX + "+", 6, 6),
    (r"[0-9a-f]", 2, 5),
    (r"^\d*$", 0, 3),
    (r"\d+", None, 4),
]
ALPHABET = "ab09 f\t+()-xX"


def _valid(s: dict, t: str) -> bool:
    return (bool(re.search(s["pattern"], t)) and len(t) >= s.get("minLength", 0)
            and len(t) <= s.get("maxLength", 10**9))


@pytest.mark.parametrize("pattern,lo,hi", CASES)
def test_rewrites_keep_the_valid_strings(pattern, lo, hi):
    s = {"type": "string", "pattern": pattern}
    if lo is not None:
        s["minLength"] = lo
    if hi is not None:
        s["maxLength"] = hi
    out = lower_patterns(s)
    assert out != s, "each case is one the rewrites handle"
    rng = random.Random(0)
    for _ in range(5000):
        t = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12)))
        assert _valid(s, t) == _valid(out, t), (pattern, t, out["pattern"])


def test_what_is_left_alone():
    assert hoist_anchors(r"^a$|b") == r"^a$|b"  # one branch unanchored
    assert hoist_anchors(r"^a|b$") == r"^a|b$"
    assert hoist_anchors(r"^a\$|^b$") == r"^a\$|^b$"  # an escaped dollar is no anchor
    assert fold_lengths(r"^[a-z]+@x$", 3, 9) is None  # more than one atom
    assert fold_lengths(HEX + "+", 3, 100) is None  # too many positions to spell out
    assert fold_lengths(r"^a+$", 5, 3) is None  # contradictory bounds: left to the checks
    data = {"enum": [{"pattern": "^a+$", "minLength": 2}]}  # values are data, not schemas
    assert lower_patterns(data) is data


@pytest.mark.parametrize("which, backend", [("xgr_compiler", "xgrammar"), ("compiler", "llguidance")])
def test_xgrammar_serves_length_bounded_patterns_exactly(request, which, backend, smol_tok):
    """Before the rewrite xgrammar ignored the lengths (approximated) and the fallback went to
    llguidance; now xgrammar serves it exactly and enforces the lengths. The default chain serves
    it from llguidance, exactly too."""
    compiler = request.getfixturevalue(which)
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": HEX + "+", "minLength": 4,
                                                      "maxLength": 4}}, "required": ["id"]}
    compiled, served = compiler.compile(spec_from_params(json_schema=schema))
    assert served == backend and compiled.exact

    def accepted(text: str) -> bool:
        m = compiled.new_matcher()
        ok = all(m.accept_token(t) for t in smol_tok.encode(text, add_special_tokens=False).ids)
        return ok and m.can_terminate()

    assert accepted('{"id": "zz0z"}') and accepted('{"id": "abcd"}')
    assert not accepted('{"id": "zzzz"}') and not accepted('{"id": "abcde"}') and not accepted('{"id": "abc"}')
