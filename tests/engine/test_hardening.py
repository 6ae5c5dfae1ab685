"""Issue 21: what a user sends can fail only its own request (cases 1, 2, 4, 6, 8)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
import textwrap

import pytest

from deepinfer import Engine, InvalidRequestError, SamplingParams
from deepinfer.errors import GrammarError, UnknownParameterError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def eng(tiny_models):
    return Engine(str(tiny_models["llama"]), kv_cache_memory=8 << 20, block_size=4)


# ---- case 1: a grammar forcing an endless continuation ----------------------------------------
def test_endless_forced_grammar_is_bounded_by_max_tokens(tiny_models):
    # in a child with a memory cap: unbounded, jump-forward grew GBs until std::bad_alloc
    code = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
        from deepinfer import Engine, SamplingParams
        eng = Engine({str(tiny_models["llama"])!r}, kv_cache_memory=8 << 20)
        # a finite language ({""}), but once an "x" is out (min_tokens=1 bans ending at once) the
        # grammar forces x's without end; the one with no finite string at all is refused (issue 51)
        outs = eng.generate(["Hi", "Hello", "Hey"],
                            [SamplingParams(max_tokens=5, min_tokens=1, grammar='root ::= "" | a\\na ::= "x" a'),
                             SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                             SamplingParams(max_tokens=5, grammar='root ::= a\\na ::= "x" a')])
        print("RESULT", outs[0].finish_reason, outs[0].text, len(outs[0].token_ids) <= 5,
              outs[1].finish_reason, len(outs[1].token_ids))
        print("EMPTY", outs[2].finish_reason, outs[2].error)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"RESULT length x+ True length 4", r.stdout), r.stdout
    assert "EMPTY error" in r.stdout and "admits no output" in r.stdout, r.stdout


def test_jump_forward_never_exceeds_the_token_budget(eng):
    sp = SamplingParams(max_tokens=3, grammar='root ::= "abcdefghij" [a-z]*')
    out = eng.generate(["Hi"], sp)[0]
    assert out.finish_reason == "length" and len(out.token_ids) <= 3


# ---- case 2: any exception while admitting one request is that request's error -----------------
def test_lone_surrogate_fails_only_its_own_request(eng):
    good = "The capital of France is"
    alone = eng.generate([good], GREEDY)[0]
    bad, ok = eng.generate(["a\ud800b", good], GREEDY)
    assert bad.finish_reason == "error" and "not valid Unicode" in bad.error
    assert ok.finish_reason == "length" and ok.token_ids == alone.token_ids
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        eng.add_request("a\ud800b", GREEDY)
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        eng.add_request([{"role": "user", "content": "x\udfffy"}], GREEDY)


def test_untyped_failure_in_admission_becomes_a_typed_error(eng, monkeypatch):
    real = eng.tokenizer.encode

    def flaky(text, *a, **kw):
        if "boom" in text:
            raise TypeError("tokenizer exploded")  # what a library may raise on odd input
        return real(text, *a, **kw)

    monkeypatch.setattr(eng.tokenizer, "encode", flaky)
    with pytest.raises(InvalidRequestError, match="TypeError: tokenizer exploded"):
        eng.add_request("boom", GREEDY)
    outs = eng.generate(["boom", "hello world"], GREEDY)
    assert outs[0].finish_reason == "error" and "tokenizer exploded" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 6
    assert not eng.has_unfinished()


# ---- case 4: prompt kind decided per element ---------------------------------------------------
@pytest.mark.parametrize(
    "prompts, kinds",
    [
        ([42, "hello world"], ["error", "length"]),
        ([{"role": "user", "content": "hi"}, "hello world"], ["error", "length"]),
        (["hello world", 42], ["length", "error"]),
        ([[5, 6, 7], "hello world", True], ["length", "length", "error"]),
        ([5, 6, 7], ["length"]),  # all ints: one token-id prompt
        ([{"role": "user", "content": "hi"}], ["length"]),  # all dicts: one conversation
        ("hello world", ["length"]),
        ({"role": "user", "content": "hi"}, ["error"]),  # a bare dict is one bad prompt, not its keys
        (b"hello", ["error"]),  # bytes are one bad prompt, not a batch of ints
        ((p for p in ["hello world", 7]), ["length", "error"]),  # any other iterable is a batch
    ],
)
def test_mixed_batches_are_read_per_element(eng, prompts, kinds):
    outs = eng.generate(prompts, GREEDY)
    assert [o.finish_reason for o in outs] == kinds
    for o in outs:
        if o.finish_reason == "error":
            assert o.error.startswith("InvalidRequestError: prompt must be")


# ---- case 6: SamplingParams types --------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(temperature="0.5"), "temperature"),
        (dict(top_p="1"), "top_p"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(min_p=float("inf")), "min_p"),
        (dict(stop=5), "stop"),
        (dict(stop={"a": 1}), "stop"),
        (dict(stop={"a"}), "stop"),
        (dict(stop=["a", 3]), "stop"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=["1"]), "stop_token_ids"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(min_tokens=False), "min_tokens"),
        (dict(top_k=True), "top_k"),
        (dict(seed=True), "seed"),
        (dict(seed="7"), "seed"),
        (dict(logprobs=True), "logprobs"),
        (dict(prompt_logprobs=1.0), "prompt_logprobs"),
        (dict(ignore_eos=1), "ignore_eos"),
        (dict(json_object="yes"), "json_object"),
        (dict(complete_within_budget="no"), "complete_within_budget"),
        (dict(skip_special_tokens=None), "skip_special_tokens"),
        (dict(regex=5), "regex"),
        (dict(grammar=["root ::= x"]), "grammar"),
        (dict(choices="ab"), "choices"),
    ],
)
def test_sampling_params_types_are_strict(kw, field):
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams: {field} must be"):
        SamplingParams(**kw)


def test_sampling_params_unknown_fields_are_typed_errors():
    """An unknown field used to be the dataclass's bare TypeError; now it is an InvalidRequestError
    naming the field (still a TypeError, as Python's own unexpected-keyword error is)."""
    n_hint = r"SamplingParams: unknown field 'n' \(.*gen\(\.\.\., n=k\)"  # names where n is supported
    with pytest.raises(UnknownParameterError, match=n_hint) as info:
        SamplingParams(n=2)
    assert isinstance(info.value, InvalidRequestError) and isinstance(info.value, TypeError)
    with pytest.raises(InvalidRequestError, match=r"unknown field 'temprature' \(did you mean 'temperature'\?\)"):
        SamplingParams(temprature=0.5)
    with pytest.raises(InvalidRequestError, match=r"unknown field 'max_new_tokens' \(did you mean 'max_tokens'\?\); "
                                                  r"unknown field 'zzz'$"):
        SamplingParams(max_tokens=2, max_new_tokens=3, zzz=1)
    with pytest.raises(UnknownParameterError, match="unknown field 'n'"):  # replace goes through __init__
        dataclasses.replace(SamplingParams(), n=2)
    # the good path is the generated __init__: values, checks and the signature are unchanged
    p = dataclasses.replace(SamplingParams(temperature=0, max_tokens=5), max_tokens=3)
    assert (p.temperature, p.max_tokens) == (0.0, 3)
    assert list(inspect.signature(SamplingParams).parameters)[:2] == ["max_tokens", "min_tokens"]
    with pytest.raises(InvalidRequestError, match="SamplingParams: temperature must be"):
        SamplingParams(temperature="hot")


def test_sampling_params_accept_and_normalise_good_numbers():
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=1, max_tokens=np.int64(4), top_p=np.float32(0.5), stop=("a", "b"),
                       stop_token_ids=(3,), seed=np.int32(2))
    assert type(p.temperature) is float and type(p.max_tokens) is int and type(p.seed) is int
    assert p.stop == ["a", "b"] and p.stop_token_ids == [3] and p.top_p == 0.5


# ---- case 8: a constraint whose language is empty ----------------------------------------------
@pytest.mark.parametrize("kw", [dict(regex=r"[^\s\S]"), dict(regex=r"a[^\d\D]b"), dict(regex="(?!)"),
                                dict(regex=r"[^\x00-\U0010ffff]+"), dict(regex=r"(x[^\w\W]|[^\d\D])y")])
def test_empty_language_is_a_grammar_error_at_submission(eng, kw):
    with pytest.raises(GrammarError, match="matches no string"):
        eng.add_request("hi", SamplingParams(max_tokens=4, **kw))
    bad, ok = eng.generate(["hi", "hello world"], [SamplingParams(max_tokens=4, **kw), GREEDY])
    # InvalidSpecError is the GrammarError of a spec no backend may serve
    assert bad.finish_reason == "error" and ("GrammarError" in bad.error or "InvalidSpecError" in bad.error)
    assert ok.finish_reason == "length"



@pytest.mark.parametrize("pattern", [r"[^\s]", r"x{0}[^\s\S]?", r"[^\s\S]|b", r"a*"])
def test_regexes_with_an_empty_part_that_still_match_are_accepted(eng, pattern):
    out = eng.generate(["hi"], SamplingParams(max_tokens=2, regex=pattern))[0]
    assert out.finish_reason != "error", out.error
