"""Streaming decode: pieces never split characters and always add up to the full decode."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.tokenizer import IncrementalDetokenizer
from deepinfer.errors import InvalidRequestError


def _stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    pieces = [d.add(i) for i in ids]
    tail = d.flush()
    return d, pieces, tail


def _partial_byte_token_ids(tok):
    """Ids whose byte-level spelling is not a whole UTF-8 string (pieces of multi-byte characters)."""
    out = []
    for i in range(tok.vocab_size):
        s = tok.hf.decode([i], skip_special_tokens=False)
        if "\ufffd" in s:
            out.append(i)
    return out


@pytest.fixture(scope="module")
def partial_ids(tok):
    ids = _partial_byte_token_ids(tok)
    assert len(ids) > 100  # byte-level vocabularies have many such tokens
    return ids


def test_multibyte_text_streams_without_replacement_chars(tok):
    text = "Emoji 😀🎉 and 日本語, Ελληνικά, 👨‍👩‍👧 done."
    ids = tok.encode(text)
    d, pieces, tail = _stream(tok, ids)
    assert "".join(pieces) == text and tail == ""
    assert all("\ufffd" not in p for p in pieces)
    assert d.text == text


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_equal_full_decode(tok, partial_ids, seed):
    rng = random.Random(seed)
    pool_text = tok.encode("Hello wörld 😀 日本 ∑ code: x=1;\n")
    ids = []
    for _ in range(60):
        r = rng.random()
        if r < 0.4:
            ids.append(rng.choice(partial_ids))
        elif r < 0.5:
            ids.append(rng.randrange(0, 17))  # special tokens
        elif r < 0.75:
            ids.append(rng.choice(pool_text))
        else:
            ids.append(rng.randrange(tok.vocab_size))
    for skip in (True, False):
        d, pieces, tail = _stream(tok, ids, skip_special_tokens=skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) + tail == full
        assert d.text == full
        # Every emitted piece (all but the flushed tail) ends on a complete character.
        assert all(not p.endswith("\ufffd") for p in pieces)


def test_split_emoji_is_held_back_until_complete(tok):
    emoji_ids = tok.encode("😀")
    assert len(emoji_ids) > 1  # the byte-level vocabulary splits it
    d = IncrementalDetokenizer(tok)
    assert [d.add(i) for i in emoji_ids[:-1]] == [""] * (len(emoji_ids) - 1)
    assert d.add(emoji_ids[-1]) == "😀"


def test_text_includes_held_back_tail(tok):
    ids = tok.encode("ab😀")
    d = IncrementalDetokenizer(tok)
    for i in ids[:-1]:
        d.add(i)
    assert d.text == tok.decode(ids[:-1])  # includes the replacement char of the incomplete emoji


def test_prompt_context_does_not_change_byte_level_output(tok):
    prompt = tok.encode("The answer is")
    gen = tok.encode(" forty-two 😀 ok")
    d, pieces, tail = _stream(tok, gen, prompt_ids=prompt)
    assert "".join(pieces) + tail == tok.decode(gen)


def test_out_of_range_id_is_rejected(tok):
    with pytest.raises(InvalidRequestError):
        IncrementalDetokenizer(tok).add(tok.vocab_size)
