"""Constraints that match no string are found at compile time (issue 21, case 8)."""

from __future__ import annotations

import pytest

from deepinfer.errors import GrammarError
from deepinfer.grammar import emptiness, spec_from_params
from deepinfer.grammar.emptiness import regex_is_empty


@pytest.mark.parametrize("pattern", [r"[^\s\S]", r"a[^\d\D]b", r"(?!)", r"(?!x?)a", r"[^\x00-\U0010ffff]",
                                     r"[^\x00-a\x62-\U0010ffff]", r"(a[^\w\W]|b(?!))c", r"(x[^\s\S]){2,3}"])
def test_empty_regexes(pattern):
    assert regex_is_empty(pattern)


@pytest.mark.parametrize("pattern", [r"[^\s]", r"x{0}[^\s\S]?", r"[^\s\S]|b", r"x[^\s\S]*y", r"[^\x00-a]",
                                     r"(?!a)b", r"\d+", "(", r"[^\x00-a\x63-\U0010ffff]", ""])
def test_non_empty_or_unparsable_regexes(pattern):
    assert not regex_is_empty(pattern)


@pytest.mark.parametrize("which", ["compiler", "outlines_compiler"])
def test_compiler_refuses_an_empty_regex_on_every_backend(request, which):
    c = request.getfixturevalue(which)
    with pytest.raises(GrammarError, match="matches no string"):
        c.compile(spec_from_params(regex=r"[^\s\S]+"))


def test_dead_first_step_is_caught_when_the_regex_analysis_misses_it(compiler, monkeypatch):
    # the second line of defence: a fresh matcher that allows nothing and cannot end
    monkeypatch.setattr(emptiness, "regex_is_empty", lambda p: False)
    monkeypatch.setattr("deepinfer.grammar.compiler.regex_is_empty", lambda p: False)
    with pytest.raises(GrammarError, match="no token can start it"):
        compiler.compile(spec_from_params(regex=r"[^\s\S]x"))
    compiler.compile(spec_from_params(regex=r"x[^\s\S]?"))  # a live one still compiles
