"""Every backend through the common matcher interface, driven by seeded random walks."""

from __future__ import annotations

import re

import outlines_core as oc
import pytest
import xgrammar as xgr

from deepinfer.errors import GrammarError
from deepinfer.grammar import allocate_token_bitmask, allowed_token_ids, decode_output, jump_forward, spec_from_params

BACKENDS = ["compiler", "outlines_compiler", "llg_compiler"]
WALKERS = {"compiler": "walker", "outlines_compiler": "outlines_walker", "llg_compiler": "llg_walker"}

REGEXES = [
    r"[0-9]+(\.[0-9]+)?",
    r"a|aa|aaa",
    r"(cat|dog)s? (and|or) (cat|dog)s?",
    r"[a-z]{2,5}@[a-z]{2,5}\.(com|org)",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"(yes|no)(, (yes|no)){0,3}",
]


def _setup(request, which):
    return request.getfixturevalue(which), request.getfixturevalue(WALKERS[which])


@pytest.mark.parametrize("which", BACKENDS)
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_walks_fullmatch(request, which, pattern):
    c, w = _setup(request, which)
    compiled, served = c.compile(spec_from_params(regex=pattern))
    assert served == c.backend_order("regex")[0]  # the default chain's is xgrammar
    outs = set()
    for seed in range(6):
        text, done = w.run(compiled.new_matcher(), seed)
        assert done, f"walk did not terminate: {text!r}"
        assert re.fullmatch(pattern, text), text
        outs.add(text)
    assert len(outs) > 1  # the walk explores, it is not one fixed path


@pytest.mark.parametrize("which", BACKENDS)
def test_choices_are_exact(request, which):
    c, w = _setup(request, which)
    choices = ["yes", "no (maybe)", "a.b*c", 'say "hi"\\n', "日本", "yes!"]
    compiled, _ = c.compile(spec_from_params(choices=choices))
    seen = set()
    for seed in range(16):
        text, done = w.run(compiled.new_matcher(), seed)
        assert done and text in choices, text
        seen.add(text)
    assert len(seen) >= 3
    # a choice that is a prefix of another: both reachable, the matcher can stop after "yes"
    m = compiled.new_matcher()
    for t in c.tokenizer.encode("yes", add_special_tokens=False).ids:
        assert m.accept_token(t)
    assert m.can_terminate()


@pytest.mark.parametrize("which", BACKENDS)
@pytest.mark.parametrize("dtype, pytype", [(int, int), ("float", float), (bool, bool), (str, str)])
def test_dtype_walks_decode(request, which, dtype, pytype):
    c, w = _setup(request, which)
    spec = spec_from_params(dtype=dtype)
    compiled, _ = c.compile(spec)
    for seed in range(4):
        text, done = w.run(compiled.new_matcher(), seed)
        assert done
        assert type(decode_output(spec, text)) is pytype


ARITHMETIC_EBNF = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]{0,2}
'''


def _walks_are_arithmetic(walker, compiled, seeds: int) -> None:
    for seed in range(seeds):
        text, done = walker.run(compiled.new_matcher(), seed)
        assert done
        assert re.fullmatch(r"[-+()0-9]+", text) and text.count("(") == text.count(")")
        eval(text)  # a well-formed arithmetic expression


def test_ebnf_walk(compiler, walker):
    compiled, served = compiler.compile(spec_from_params(grammar=ARITHMETIC_EBNF))
    assert served == "xgrammar"
    _walks_are_arithmetic(walker, compiled, 6)


def test_llguidance_compiles_ebnf(llg_compiler, llg_walker, smol_eos):
    """llguidance serves GBNF-style EBNF itself (via its GBNF-to-Lark converter): it used to call
    the `llguidance.gbnf_to_lark` submodule as if it were the function, so every EBNF spec failed
    with "'module' object is not callable" and never reached llguidance."""
    pytest.importorskip("llguidance")
    c = llg_compiler
    compiled, served = c.compile(spec_from_params(grammar=ARITHMETIC_EBNF))
    assert served == "llguidance"
    _walks_are_arithmetic(llg_walker, compiled, 4)

    tid = c.tokenizer.token_to_id
    mask = allocate_token_bitmask(1, c.vocab_size)

    def allowed(m) -> set[int]:
        m.fill_bitmask(mask, 0)
        return set(allowed_token_ids(mask[0], c.vocab_size).tolist())

    m = compiled.new_matcher()
    first = allowed(m)
    assert tid("(") in first and tid("7") in first
    assert tid(")") not in first and tid("0") not in first and tid("x") not in first and smol_eos not in first
    assert not m.accept_token(tid(")"))  # refused, state unchanged
    assert not m.accept_token(tid("0"))  # num starts with [1-9]
    for s in ["(", "1", "2", "+", "3"]:
        assert m.accept_token(tid(s)), s
    assert not m.can_terminate() and smol_eos not in allowed(m)  # "(12+3" is unbalanced
    assert tid(")") in allowed(m)
    assert m.accept_token(tid(")"))
    assert m.can_terminate() and smol_eos in allowed(m)  # "(12+3)" is in the language
    assert not m.accept_token(tid("("))  # no implicit product: "(12+3)(" cannot continue


def test_llguidance_rejects_invalid_ebnf(llg_compiler):
    pytest.importorskip("llguidance")
    with pytest.raises(GrammarError, match="invalid EBNF") as e:
        llg_compiler.compile(spec_from_params(grammar="root ::= foo"))  # foo is never defined
    assert "not callable" not in str(e.value)  # the grammar's fault, not the converter call's
    # the backend named once (was "llguidance: invalid EBNF (llguidance): ...")
    assert str(e.value).startswith("invalid EBNF (llguidance): "), str(e.value)


def test_gbnf_empty_alternative_is_served(compiler):
    """GBNF allows an empty alternative (llama.cpp's json.gbnf: `ws ::= | " " | ...`). xgrammar refuses
    it; with the fallback llguidance, which can now compile EBNF, serves it exactly."""
    pytest.importorskip("llguidance")
    compiled, served = compiler.compile(spec_from_params(grammar='root ::= "a" |'))
    assert served in ("xgrammar", "llguidance") and compiled.exact
    tid = compiler.tokenizer.token_to_id
    m = compiled.new_matcher()
    assert m.can_terminate()  # "" is in the language
    assert not m.accept_token(tid("b"))
    assert m.accept_token(tid("a")) and m.can_terminate()
    assert not m.accept_token(tid("a"))  # "aa" is not


@pytest.mark.parametrize("which", BACKENDS)
def test_eos_only_when_grammar_can_terminate(request, which, smol_eos):
    c, _ = _setup(request, which)
    m = c.new_matcher(spec_from_params(regex=r"ab+c?"))
    mask = allocate_token_bitmask(1, c.vocab_size)

    def allowed() -> set[int]:
        m.fill_bitmask(mask, 0)
        return set(allowed_token_ids(mask[0], c.vocab_size).tolist())

    enc = lambda s: c.tokenizer.encode(s, add_special_tokens=False).ids  # noqa: E731
    assert smol_eos not in allowed() and not m.can_terminate()
    assert not m.accept_token(smol_eos)  # rejected, state unchanged
    assert m.accept_token(enc("a")[0])
    assert smol_eos not in allowed()
    assert m.accept_token(enc("b")[0])
    assert smol_eos in allowed() and m.can_terminate()
    assert enc("b")[0] in allowed() and enc("c")[0] in allowed()  # can end, can also go on
    assert m.accept_token(smol_eos) and m.is_terminated()
    assert not m.accept_token(enc("b")[0])


@pytest.mark.parametrize("which", BACKENDS)
def test_rejects_disallowed_tokens_and_rolls_back(request, which):
    c, _ = _setup(request, which)
    m = c.new_matcher(spec_from_params(regex=r"[0-9]{3}"))
    one = c.tokenizer.token_to_id("1")
    x = c.tokenizer.token_to_id("x")
    assert not m.accept_token(x)
    assert not m.accept_token(c.vocab_size - 1)  # an id past the tokenizer
    assert m.accept_token(one) and m.accept_token(one)
    assert m.supports_rollback
    m.rollback(2)
    for _ in range(3):
        assert m.accept_token(one)
    assert m.can_terminate() and not m.accept_token(one)
    m.reset()
    assert not m.can_terminate() and m.accept_token(one)


def test_outlines_core_fault_is_guarded(smol_tok, outlines_compiler):
    """Raw outlines-core drops the transitions out of accepting states ("." after "9" in
    [0-9]+(\\.[0-9]+)?); our outlines backend keeps them."""
    pattern = r"[0-9]+(\.[0-9]+)?"
    nine, dot = smol_tok.token_to_id("9"), smol_tok.token_to_id(".")
    vocab = oc.Vocabulary(smol_tok.get_vocab_size() + 1, {b"9": [nine], b".": [dot]})
    guide = oc.Guide(oc.Index(pattern, vocab))
    guide.advance(nine, return_tokens=False)
    assert dot not in guide.get_tokens(), "outlines-core fixed the fault: the guard can be revisited"

    m = outlines_compiler.new_matcher(spec_from_params(regex=pattern))
    mask = allocate_token_bitmask(1, outlines_compiler.vocab_size)
    assert m.accept_token(nine)
    m.fill_bitmask(mask, 0)
    assert dot in allowed_token_ids(mask[0], outlines_compiler.vocab_size).tolist()
    assert m.can_terminate()
    assert m.accept_token(dot) and not m.can_terminate()
    assert m.accept_token(nine) and m.can_terminate()


@pytest.mark.parametrize("which", ["xgr_compiler", "compiler"])
def test_xgrammar_builtin_json_fault_is_avoided(request, which):
    """xgrammar's builtin JSON grammar masks `}]` after `[{"b": "x"` although its matcher accepts
    it; json_object mode goes through the schema path, whose mask allows it (on xgrammar alone,
    and on the default chain, which serves it from llguidance)."""
    compiler, walker = request.getfixturevalue(which), request.getfixturevalue(which.replace("compiler", "walker"))
    tok = compiler.tokenizer
    close = tok.token_to_id("}]")
    assert close is not None
    prefix = '{"a": [{"b": "x"'
    builtin = xgr.GrammarMatcher(compiler.get_backend("xgrammar")._compiler.compile_builtin_json_grammar())
    assert builtin.accept_string(prefix)
    bm = xgr.allocate_token_bitmask(1, compiler.vocab_size)
    builtin.fill_next_token_bitmask(bm)
    assert close not in allowed_token_ids(bm[0], compiler.vocab_size).tolist(), "xgrammar fixed the fault"

    compiled, _ = compiler.compile(spec_from_params(json_object=True))
    m = compiled.new_matcher()
    for t in tok.encode(prefix, add_special_tokens=False).ids:
        assert m.accept_token(t)
    mask = allocate_token_bitmask(1, compiler.vocab_size)
    m.fill_bitmask(mask, 0)
    assert close in allowed_token_ids(mask[0], compiler.vocab_size).tolist()
    assert m.accept_token(close) and m.accept_token(tok.token_to_id("}")) and m.can_terminate()
    import json

    for seed in range(4):  # and random walks give JSON objects
        text, done = walker.run(compiled.new_matcher(), seed)
        assert done and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("which", BACKENDS)
def test_jump_forward_appends_forced_tokens(request, which):
    c, _ = _setup(request, which)
    spec = spec_from_params(regex=r'\{"name": "[a-z]+", "kind": "(cat|cow)"\}')
    m = c.new_matcher(spec)
    jf = jump_forward(m, c.tokenizer, c.token_bytes)
    assert jf.forced == '{"name": "'
    assert jf.text == jf.forced and jf.token_ids
    for t in c.tokenizer.encode("bob", add_special_tokens=False).ids:
        assert m.accept_token(t)
    assert jump_forward(m, c.tokenizer, c.token_bytes).text == ""  # more letters or the quote
    assert m.accept_token(c.tokenizer.token_to_id('"'))
    jf = jump_forward(m, c.tokenizer, c.token_bytes)
    assert jf.forced == ', "kind": "c'
    # only tokens whose concatenation is exactly a prefix of the forced string, all accepted
    assert jf.forced.startswith(jf.text) and len(jf.text) > 0
    assert b"".join(c.token_bytes[t] for t in jf.token_ids) == jf.text.encode()
    held = c.new_matcher(spec)
    jf_held = jump_forward(held, c.tokenizer, c.token_bytes, hold_last=True)
    assert len(jf_held.token_ids) == len(c.tokenizer.encode('{"name": "', add_special_tokens=False).ids) - 1


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        (dict(regex="a(b"), "invalid regex"),
        (dict(grammar="root ::= foo"), "invalid EBNF"),
        (dict(json_schema={"type": "nonsense"}), "invalid JSON schema"),
        (dict(json_schema={"type": "string", "pattern": "a(b"}), "invalid"),
    ],
)
def test_invalid_specs_raise_grammar_error(compiler, kwargs, problem):
    with pytest.raises(GrammarError, match=problem):
        compiler.compile(spec_from_params(**kwargs))
    with pytest.raises(GrammarError):  # cached failures raise again
        compiler.compile(spec_from_params(**kwargs))


def test_outlines_rejects_ebnf(outlines_compiler):
    with pytest.raises(GrammarError, match="EBNF needs xgrammar"):
        outlines_compiler.compile(spec_from_params(grammar='root ::= "x"'))


@pytest.mark.parametrize("pattern", REGEXES[:4])
def test_both_backends_give_the_same_masks(compiler, outlines_compiler, pattern):
    """Along random paths, outlines' mask (with the end-marker guard) equals xgrammar's: no
    dropped transitions, no marker bytes, no ids past the tokenizer."""
    import random

    import torch

    spec = spec_from_params(regex=pattern)
    V = compiler.vocab_size
    xm, om = compiler.new_matcher(spec), outlines_compiler.new_matcher(spec)
    xmask, omask = allocate_token_bitmask(1, V), allocate_token_bitmask(1, V)
    rng = random.Random(0)
    for _ in range(12):
        xm.fill_bitmask(xmask, 0)
        om.fill_bitmask(omask, 0)
        assert torch.equal(xmask, omask)
        allowed = allowed_token_ids(xmask[0], V).tolist()
        stops = set(compiler.vocab.stop_token_ids)
        choices = [t for t in allowed if t not in stops]
        if not choices:
            break
        t = rng.choice(choices)
        assert xm.accept_token(t) and om.accept_token(t)


def test_outlines_refuses_huge_repetitions(outlines_compiler):
    """A DFA over bytes copies a bounded repetition's body: maxLength 5000 would take minutes."""
    with pytest.raises(GrammarError, match=r"repetition \{0,5000\} exceeds"):
        outlines_compiler.compile(spec_from_params(json_schema={"type": "string", "maxLength": 5000}))
