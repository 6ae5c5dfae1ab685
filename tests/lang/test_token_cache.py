"""SegmentEncoder: pieces between chat markers encoded once, ids always equal to a whole encode."""

import random

import pytest

from deepinfer.lang.chat_template import analyze_chat_template
from deepinfer.lang.testing import FakeTokenizer
from deepinfer.lang.token_cache import SegmentEncoder


def _markup(tok):
    fmt = analyze_chat_template(tok)
    return [*fmt.start.values(), *fmt.prefix.values(), *fmt.suffix.values()]


def _random_texts(n, seed=0):
    rng = random.Random(seed)
    pieces = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "user\n", "assistant\n", "the capital", " is ",
              "Paris", "\n", "  ", "é", "Question 12:", " yes", "ing", "<|im", "_end|>", "", "answer"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))) for _ in range(n)]


class _CountingTokenizer(FakeTokenizer):
    def __init__(self):
        super().__init__()
        self.encoded = []

    def encode(self, text, add_special_tokens=False):
        self.encoded.append(text)
        return super().encode(text, add_special_tokens)


def test_equals_whole_encode_and_encodes_shared_pieces_once():
    tok = _CountingTokenizer()
    enc = SegmentEncoder(tok, _markup(tok))
    assert enc.markers == ["<|im_start|>", "<|im_end|>"]  # the template's markup, not every special
    for text in _random_texts(500):
        assert enc.encode(text) == tok.encode(text), text
    enc = SegmentEncoder(tok, _markup(tok))  # empty cache
    tok.encoded.clear()
    turn = "<|im_end|>\n<|im_start|>user\nQuestion {}: what is the answer?<|im_end|>\n<|im_start|>assistant\n"
    for i in range(5):
        enc.encode(turn.format(i))
    # each program's own text once; "\n" and "assistant\n" (shared) only the first time
    assert tok.encoded == ["\n", "user\nQuestion 0: what is the answer?", "assistant\n"] + [
        f"user\nQuestion {i}: what is the answer?" for i in range(1, 5)]


class _StrippingTokenizer(FakeTokenizer):
    """A tokenizer whose <|im_end|> swallows the whitespace after it (like an rstrip added token)."""

    def encode(self, text, add_special_tokens=False):
        import re

        return super().encode(re.sub(r"<\|im_end\|>\s+", "<|im_end|>", text), add_special_tokens)


def test_marker_that_changes_its_neighbours_is_not_cut_at():
    tok = _StrippingTokenizer()
    enc = SegmentEncoder(tok, _markup(tok))
    assert "<|im_end|>" not in enc.markers and "<|im_start|>" in enc.markers
    for text in _random_texts(300, seed=1):
        assert enc.encode(text) == tok.encode(text), text


def test_without_markers_whole_strings_are_cached():
    tok = _CountingTokenizer()
    enc = SegmentEncoder(tok, [])
    assert enc.markers == []
    assert enc.encode("\nIn short:") == enc.encode("\nIn short:") == tok.encode("\nIn short:")
    assert tok.encoded.count("\nIn short:") == 2  # the encoder's one + the check's one
    assert enc.encode("") == []


def test_bounded_cache():
    tok = FakeTokenizer()
    enc = SegmentEncoder(tok, _markup(tok), max_entries=8)
    for i in range(100):
        assert enc.encode(f"<|im_start|>user\nq{i}<|im_end|>\n") == tok.encode(f"<|im_start|>user\nq{i}<|im_end|>\n")
    assert len(enc._cache) <= 8


def test_real_tokenizer_pieces_equal_whole_encode():
    """The default model's byte-level BPE: cutting at ChatML markers gives the whole string's ids."""
    import glob

    from deepinfer.engine.tokenizer import Tokenizer

    dirs = sorted(glob.glob("/root/.cache/deepinfer/models/SmolLM2-135M-Instruct*/tokenizer.json"))
    if not dirs:
        pytest.skip("no cached SmolLM2 tokenizer")
    import os

    tok = Tokenizer.from_dir(os.path.dirname(dirs[0]))
    enc = SegmentEncoder(tok, _markup(tok))
    assert enc.markers  # ChatML markers are separable for this tokenizer
    for text in _random_texts(300, seed=2):
        assert enc.encode(text) == tok.encode(text), text


def test_program_state_ids_unchanged_by_the_encoder(engine):
    """The backend encodes through the SegmentEncoder; a program's ids equal the template rendering."""
    import deepinfer as di

    @di.function
    def chat(s, q):
        s += di.system("You are terse.")
        s += di.user(q)
        s += di.assistant(di.gen("a", max_tokens=6))
        s += di.user("Again: " + q)
        s += di.assistant(di.gen("b", max_tokens=6))

    states = chat.run_batch([{"q": f"Question {i}: the capital?"} for i in range(4)], backend=engine)
    tok = engine.tokenizer
    for st in states:
        assert st.ok, st.error()
        assert st.token_ids() == tok.encode(tok.apply_chat_template(st.messages(), add_generation_prompt=False))
