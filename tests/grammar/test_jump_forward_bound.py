"""Jump-forward is bounded whatever the grammar (issue 21, case 1), and the bounded probe of the
xgrammar backend finds the same forced strings as xgrammar's own unbounded search."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.errors import InvalidSpecError
from deepinfer.grammar import allocate_token_bitmask, jump_forward, spec_from_params
from deepinfer.grammar.backend import MAX_JUMP_FORWARD_BYTES

ENDLESS = 'root ::= a\na ::= "x" a'  # no finite string: refused at compile (issue 51: admits no output)
# a finite language ({"y"}) whose "x" branch forces an endless continuation
ENDLESS_AFTER_X = 'root ::= "y" | "x" a\na ::= "x" a'
STUCK = 'root ::= "a" | "b" c\nc ::= "x" c'  # finite language, but "b" leads to an endless force
BACKENDS = ["compiler", "outlines_compiler"]


def test_a_grammar_with_no_finite_string_admits_no_output(compiler):
    with pytest.raises(InvalidSpecError, match="admits no output"):
        compiler.new_matcher(spec_from_params(grammar=ENDLESS))


def test_endless_forced_string_is_cut_at_the_bound(compiler):
    m = compiler.new_matcher(spec_from_params(grammar=ENDLESS_AFTER_X))
    assert m.accept_token(compiler.tokenizer.token_to_id("x"))
    assert m.find_jump_forward_string(40) == "x" * 40
    assert m.find_jump_forward_string() == "x" * MAX_JUMP_FORWARD_BYTES
    assert m.find_jump_forward_string(0) == ""
    # a jump longer than max_bytes is not taken at all; one within it is
    assert jump_forward(m, compiler.tokenizer, compiler.token_bytes, max_bytes=30).token_ids == []
    assert not m.can_terminate()


def test_stuck_branch_of_a_finite_grammar_is_bounded(compiler):
    m = compiler.new_matcher(spec_from_params(grammar=STUCK))
    assert m.find_jump_forward_string(16) == ""  # "a" or "b": nothing forced yet
    assert m.accept_token(compiler.tokenizer.token_to_id("b"))
    assert m.find_jump_forward_string(16) == "x" * 16


CASES = [
    dict(regex=r'\{"name": "[a-z]+", "kind": "(cat|cow)"\}'),
    dict(regex=r"(héllo|hèllo) wörld [0-9]{2}"),
    dict(json_schema={"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
        "type": "array", "items": {"enum": ["alpha", "alpine", "beta"]}}}, "required": ["id", "tags"]}),
    dict(grammar='root ::= "say: " ("yes" | "yet" | "no") "!" " done"'),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: next(iter(c)))
def test_bounded_probe_matches_xgrammar_native(xgr_compiler, case):
    compiler = xgr_compiler  # xgrammar's probe (the default chain serves schemas from llguidance)
    compiled, served = compiler.compile(spec_from_params(**case))
    assert served == "xgrammar"
    mask = allocate_token_bitmask(1, compiler.vocab_size)
    shifts = torch.arange(32, dtype=torch.int32)
    checked = 0
    for seed in range(3):
        rng = random.Random(seed)
        m = compiled.new_matcher()
        for _ in range(40):
            native = m._m.find_jump_forward_string()  # safe here: these grammars force finite strings
            assert m.find_jump_forward_string() == native
            checked += bool(native)
            if m.can_terminate():
                break
            m.fill_bitmask(mask, 0)
            allowed = ((mask[0].unsqueeze(1) >> shifts) & 1).flatten()[: compiler.vocab_size].nonzero().flatten()
            allowed = [t for t in allowed.tolist() if t not in compiler.vocab.stop_token_ids]
            assert m.accept_token(rng.choice(allowed))
    assert checked > 0, "the walk never met a forced string: the comparison proved nothing"


@pytest.mark.parametrize("which", BACKENDS)
def test_both_backends_honour_max_bytes(request, which):
    c = request.getfixturevalue(which)
    m = c.new_matcher(spec_from_params(regex=r'\{"name": "[a-z]+"\}'))
    assert m.find_jump_forward_string() == '{"name": "'
    assert m.find_jump_forward_string(4) == '{"na'
