"""stop_regex: generation stops where the output text first matches a regex; the match is kept."""

from __future__ import annotations

import re

import pytest

from deepinfer import Engine, InvalidRequestError, SamplingParams
from deepinfer.lang import function, gen


@pytest.fixture(scope="module")
def eng(tiny_models):
    return Engine(str(tiny_models["llama"]), kv_cache_memory=8 << 20)


PROMPT = "the quick brown fox"


def _free(eng):
    out = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert len(out.text) > 12
    return out


def test_stops_at_the_earliest_ending_match(eng):
    free = _free(eng)
    lit = re.escape(free.text[6:9])
    # a character class around a later literal, and the literal: the earliest-ending match wins
    late = "[" + re.escape(free.text[10]) + "]" + re.escape(free.text[11:13])
    out = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop_regex=[late, lit]))[0]
    first = min((m for m in (re.search(late, free.text), re.search(lit, free.text))), key=lambda m: m.end())
    assert out.finish_reason == "stop"
    assert out.text == free.text[: first.end()]
    assert out.stop_reason == first.group(0)
    assert free.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(free.token_ids)


def test_no_match_runs_to_max_tokens_and_min_tokens_defers(eng):
    free = _free(eng)
    out = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                stop_regex="ZZZ[0-9]{40}"))[0]
    assert out.finish_reason == "length" and out.text == free.text
    # min_tokens: the regex is only checked once min_tokens are out (as stop strings are)
    lit = re.escape(free.text[:2])
    early = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_regex=lit))[0]
    late = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_regex=lit,
                                                 min_tokens=8))[0]
    assert len(early.token_ids) < 8 <= len(late.token_ids)


@pytest.mark.parametrize("bad, msg", [("(", "not a valid regular expression"), ("a*", "matches the empty string"),
                                      ([1], "stop_regex must be")])
def test_bad_regex_is_a_typed_error(bad, msg):
    with pytest.raises(InvalidRequestError, match=msg):
        SamplingParams(stop_regex=bad)


@function
def _prog(s):
    s += PROMPT + gen("x", max_tokens=30, temperature=0, ignore_eos=True, stop_regex=r"\s\w\w")


def test_dsl_gen_passes_stop_regex(eng):
    free = _free(eng)
    m = re.search(r"\s\w\w", free.text)
    if m is None:
        pytest.skip("the tiny model's output has no whitespace followed by two word characters")
    st = _prog.run(backend=eng)
    assert st["x"] == free.text[: m.end()]
