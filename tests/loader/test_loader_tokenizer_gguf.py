"""The tokenizer rebuilt from GGUF metadata against transformers' conversion of the same file."""

from __future__ import annotations

import json

import pytest

from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.errors import InvalidRequestError

TEXTS = [
    "Hello world",
    "  leading and trailing spaces   ",
    "Numbers: 1234567890, 3.14159, -42, 1e-5 and 2024-11-30.",
    "tabs\tand\nnew\n\nlines\r\n",
    "Unicode: café, naïve, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, עברית, العربية",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\nprint({'a': [1, 2, 3]})",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure you've seen it; they'll say we'd DON'T",
    "a" * 50 + " " + "ab" * 20,
    "",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_gguf_tokenizer(tok, hf_gguf_tokenizer, text):
    ref = hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.encode(text) == ref
    assert tok.decode(ref, skip_special_tokens=False) == hf_gguf_tokenizer.decode(ref, skip_special_tokens=False)


def test_special_ids_match_transformers(tok, hf_gguf_tokenizer):
    assert tok.vocab_size == len(hf_gguf_tokenizer) == 49152
    assert tok.bos_token_id == hf_gguf_tokenizer.bos_token_id
    assert tok.pad_token_id == hf_gguf_tokenizer.pad_token_id
    assert tok.eos_token_ids[0] == hf_gguf_tokenizer.eos_token_id
    assert tok.special_token_ids == set(hf_gguf_tokenizer.all_special_ids) | {
        i for i, t in hf_gguf_tokenizer.added_tokens_decoder.items() if t.special
    }
    assert tok.add_bos is False  # the file says add_bos_token = false


def test_eos_ids_cover_end_of_turn_tokens(tok):
    # <|im_end|> ends a chat turn (the template writes it); <|endoftext|> ends a document.
    assert tok.eos_token_ids[0] == tok.token_to_id("<|im_end|>")
    assert tok.token_to_id("<|endoftext|>") in tok.eos_token_ids
    assert tok.token_to_id("<|im_start|>") not in tok.eos_token_ids


def test_smollm_pretokenizer_splits_digits(tok):
    pieces = [p for p, _ in tok.hf.pre_tokenizer.pre_tokenize_str("abc 2024x")]
    assert pieces == ["abc", "Ġ", "2", "0", "2", "4", "x"]
    ids = tok.encode("2024")
    assert len(ids) == 4 and tok.decode(ids) == "2024"


def test_special_token_text_maps_to_single_id_and_skips_on_decode(tok):
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_add_special_tokens_prepends_bos_only_when_model_wants_it(tok, tmp_path):
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")
    tok.save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t2 = Tokenizer.from_dir(tmp_path)
    assert t2.encode("hi", add_special_tokens=True) == [t2.bos_token_id] + tok.encode("hi")


def test_save_and_from_dir_round_trip(tok, tmp_path):
    tok.save(tmp_path)
    t2 = Tokenizer.from_dir(tmp_path)
    for text in TEXTS:
        assert t2.encode(text) == tok.encode(text)
    assert (t2.bos_token_id, t2.pad_token_id, t2.add_bos, t2.chat_template) == (
        tok.bos_token_id, tok.pad_token_id, tok.add_bos, tok.chat_template)
    assert t2.eos_token_ids == tok.eos_token_ids
    assert t2.special_token_ids == tok.special_token_ids


def test_saved_dir_reads_in_transformers(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok.save(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert ref.encode(text, add_special_tokens=False) == tok.encode(text)
    assert ref.eos_token == "<|im_end|>"


def test_id_to_token_and_range_errors(tok):
    assert tok.id_to_token(tok.token_to_id("<|im_end|>")) == "<|im_end|>"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        tok.id_to_token(tok.vocab_size)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        tok.decode([5, -1])
    with pytest.raises(InvalidRequestError, match="expects a str"):
        tok.encode(123)
