"""TokenizerVocab: a tokenizer's vocabulary as both backends need it, built once per compiler.

xgrammar wants the *encoded* token strings (e.g. "Ġhello" for byte-level BPE) plus the vocab
type; outlines-core wants each token's *bytes*. Special tokens (added tokens marked special)
and ids beyond the tokenizer (the model's logits may be wider) are never grammar tokens: they
are blank ("") in `encoded` and None in `token_bytes`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import tokenizers

from deepinfer.errors import GrammarError

VOCAB_RAW, VOCAB_BYTE_FALLBACK, VOCAB_BYTE_LEVEL = "raw", "byte_fallback", "byte_level"


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_LEVEL = _byte_level_decoder()
_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _detect_vocab_type(tok_json: dict) -> tuple[str, bool]:
    """(vocab type, add_prefix_space) from the tokenizer's serialized pipeline."""
    text = json.dumps([tok_json.get("decoder"), tok_json.get("pre_tokenizer"), tok_json.get("normalizer")])
    if '"ByteLevel"' in text:
        return VOCAB_BYTE_LEVEL, False
    if '"ByteFallback"' in text:
        # sentencepiece-style: a normalizer/pre-tokenizer that prepends "▁" adds a prefix space
        return VOCAB_BYTE_FALLBACK, '"Prepend"' in text or '"prepend_scheme": "always"' in text
    return VOCAB_RAW, False


def token_to_bytes(token: str, vocab_type: str) -> bytes:
    """The bytes one encoded token stands for."""
    if vocab_type == VOCAB_BYTE_LEVEL:
        try:
            return bytes(_BYTE_LEVEL[ch] for ch in token)
        except KeyError:  # a non-special added token stored verbatim
            return token.encode("utf-8")
    if vocab_type == VOCAB_BYTE_FALLBACK:
        m = _BYTE_FALLBACK_RE.match(token)
        if m:
            return bytes([int(m.group(1), 16)])
        return token.replace("▁", " ").encode("utf-8")
    return token.encode("utf-8")


@dataclass
class TokenizerVocab:
    """The grammar view of a tokenizer. `vocab_size` is the model's logits width (>= tokenizer
    length); `encoded`/`token_bytes` have that length."""

    vocab_size: int
    vocab_type: str
    add_prefix_space: bool
    encoded: list[str]
    token_bytes: list[bytes | None]
    stop_token_ids: list[int]
    special_ids: frozenset[int]
    #: the tokenizer itself, for backends that read its full definition (llguidance)
    tokenizer: tokenizers.Tokenizer | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_tokenizer(cls, tok: tokenizers.Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> "TokenizerVocab":
        if not isinstance(tok, tokenizers.Tokenizer):
            raise GrammarError(f"expected a tokenizers.Tokenizer, got {type(tok).__name__}")
        vocab = tok.get_vocab(with_added_tokens=True)
        n_tok = max(len(vocab), max(vocab.values()) + 1) if vocab else 0
        if not isinstance(vocab_size, int) or vocab_size < n_tok:
            raise GrammarError(f"vocab_size {vocab_size!r} is smaller than the tokenizer's {n_tok} tokens")
        stops = sorted(set(int(t) for t in stop_token_ids))
        if any(t < 0 or t >= vocab_size for t in stops):
            raise GrammarError(f"stop_token_ids {stops} must lie in [0, {vocab_size})")
        vocab_type, prefix_space = _detect_vocab_type(json.loads(tok.to_str()))
        special = {i for i, a in tok.get_added_tokens_decoder().items() if a.special}
        encoded = [""] * vocab_size
        token_bytes: list[bytes | None] = [None] * vocab_size
        for s, i in vocab.items():
            if i in special:
                continue
            encoded[i] = s
            b = token_to_bytes(s, vocab_type)
            token_bytes[i] = b if b else None
        return cls(vocab_size, vocab_type, prefix_space, encoded, token_bytes, stops, frozenset(special), tok)
