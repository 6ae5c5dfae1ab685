"""The whitespace bound of JSON grammars kept around xgrammar's matcher (grammar/ws_guard.py)."""

from __future__ import annotations


from deepinfer.grammar import allocate_token_bitmask, allowed_token_ids, spec_from_params
from deepinfer.grammar.ws_guard import MAX_JSON_WHITESPACE, WhitespaceGuard, WhitespaceTables

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}}}


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _ws_only_ids(compiler, n: int) -> list[int]:
    """n tokens of one space each (the single-space token)."""
    sp = [i for i, b in enumerate(compiler.token_bytes) if b == b" "]
    assert sp, "the vocabulary has a one-space token"
    return sp * n


def _walk(m, ids) -> bool:
    return all(m.accept_token(t) for t in ids)


def test_run_stops_growing_at_the_limit_outside_strings(compiler, smol_tok):
    spec = spec_from_params(json_schema=SCHEMA)
    m = compiler.new_matcher(spec)
    assert _walk(m, _ids(smol_tok, '{"a":'))
    space = _ws_only_ids(compiler, 1)[0]
    for _ in range(MAX_JSON_WHITESPACE):
        assert m.accept_token(space)
    mask = allocate_token_bitmask(1, compiler.vocab_size)
    m.fill_bitmask(mask, 0)
    allowed = set(allowed_token_ids(mask[0], compiler.vocab_size).tolist())
    assert space not in allowed and not m.accept_token(space)  # mask and accept agree
    # nothing starting with whitespace is left, but the value can start
    assert all(compiler.token_bytes[t] is None or not compiler.token_bytes[t][:1].isspace() for t in allowed)
    assert _ids(smol_tok, '"')[0] in allowed
    assert _walk(m, _ids(smol_tok, '"x"}')) and m.can_terminate()


def test_rollback_restores_the_run(compiler, smol_tok):
    m = compiler.new_matcher(spec_from_params(json_schema=SCHEMA))
    assert _walk(m, _ids(smol_tok, "{"))
    space = _ws_only_ids(compiler, 1)[0]
    for _ in range(MAX_JSON_WHITESPACE):
        assert m.accept_token(space)
    assert not m.accept_token(space)
    m.rollback(1)
    assert m.accept_token(space)  # one below the limit again
    m.reset()
    assert _walk(m, _ids(smol_tok, "{")) and m.accept_token(space)


def test_whitespace_inside_strings_is_content(compiler, smol_tok):
    m = compiler.new_matcher(spec_from_params(json_schema=SCHEMA))
    assert _walk(m, _ids(smol_tok, '{"a": "'))
    space = _ws_only_ids(compiler, 1)[0]
    for _ in range(3 * MAX_JSON_WHITESPACE):  # a string may hold any whitespace
        assert m.accept_token(space)
    # an escaped quote keeps the string open; its spaces are still content
    assert _walk(m, _ids(smol_tok, '\\"'))
    for _ in range(3 * MAX_JSON_WHITESPACE):
        assert m.accept_token(space)
    assert _walk(m, _ids(smol_tok, '", "b": [1,'))
    for _ in range(MAX_JSON_WHITESPACE):
        assert m.accept_token(space)
    assert not m.accept_token(space)  # between array elements the bound holds again
    assert _walk(m, _ids(smol_tok, "2]}")) and m.can_terminate()


def test_regex_grammars_are_not_bounded(compiler):
    m = compiler.new_matcher(spec_from_params(regex=" *x"))
    space = _ws_only_ids(compiler, 1)[0]
    for _ in range(3 * MAX_JSON_WHITESPACE):
        assert m.accept_token(space)


def test_guard_never_empties_a_row():
    # a two-token vocabulary where only the whitespace token is allowed: the guard keeps it
    import torch

    tables = WhitespaceTables([b" ", b"x"], words=1, limit=2)
    g = WhitespaceGuard(tables)
    for _ in range(2):
        g.push(0)
    assert g.over(0) and not g.over(1)
    mask = torch.tensor([[0b01]], dtype=torch.int32)  # only " "
    assert not g.restrict(mask, 0)  # it would be empty: the caller refills it unrestricted
    mask = torch.tensor([[0b11]], dtype=torch.int32)
    assert g.restrict(mask, 0) and int(mask[0, 0]) == 0b10


def test_random_walks_keep_the_bound(compiler, walker):
    """Walks that prefer whitespace tokens never hold a gap longer than the limit plus one
    token's whitespace."""
    import copy

    import torch

    walker = copy.copy(walker)
    walker.bias, walker.stop_p = 0.8, 0.05
    walker.structural = torch.tensor([bool(b) and b.isspace() for b in compiler.token_bytes])
    compiled, _ = compiler.compile(spec_from_params(json_schema=SCHEMA))
    longest = max((len(b) for b in compiler.token_bytes if b and b.isspace()), default=0)
    total = 0
    for seed in range(6):
        text, _ = walker.run(compiled.new_matcher(), seed, max_steps=150)
        in_str = esc = False
        run = 0
        for ch in text.encode():
            if in_str:
                esc, in_str = (False, True) if esc else (ch == 0x5C, ch != 0x22)
                continue
            if ch in b" \t\n\r":
                run += 1
                total += 1
                assert run <= MAX_JSON_WHITESPACE - 1 + longest, text
            else:
                run, in_str = 0, ch == 0x22
    assert total > 3 * MAX_JSON_WHITESPACE  # the walks did try to spin
