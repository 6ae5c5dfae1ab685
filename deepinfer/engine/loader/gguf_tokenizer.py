"""Rebuilding a `tokenizers.Tokenizer` from GGUF tokenizer metadata (llama.cpp's `tokenizer.ggml.*` keys).

Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE) with the pre-tokenizers named by
`tokenizer.ggml.pre` that the models we run use. The split regexes are the published ones of each
model family; llama.cpp picks them by the same names.
"""

from __future__ import annotations

from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from deepinfer.engine.loader.gguf_meta import field
from deepinfer.errors import ModelLoadError

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are added tokens.
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3")
_QWEN2_NAMES = ("qwen2", "deepseek-r1-qwen")
_GPT2_NAMES = ("gpt2", "default", "gpt-2")
SUPPORTED_PRE_TOKENIZERS = ("smollm",) + _GPT2_NAMES + _LLAMA3_NAMES + _QWEN2_NAMES


def _pre_tokenizer(pre: str) -> tuple[Any, bool]:
    """(pre-tokenizer, ignore_merges) for a `tokenizer.ggml.pre` name."""
    if pre == "smollm":
        # SmolLM's tokenizer.json: every digit alone, then the GPT-2 byte-level split.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]), False
    if pre in _GPT2_NAMES:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    split = _LLAMA3_SPLIT if pre in _LLAMA3_NAMES else _QWEN2_SPLIT if pre in _QWEN2_NAMES else None
    if split is None:
        raise ModelLoadError(
            f"GGUF tokenizer pre-tokenizer {pre!r} is not supported; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )
    seq = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    # Llama-3 vocabularies match whole pre-tokens that are in the vocabulary before merging.
    return seq, pre in _LLAMA3_NAMES


def tokenizer_parts_from_gguf(reader: Any) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """(`tokenizers.Tokenizer`, keyword arguments for `Tokenizer(...)`) from a GGUFReader's metadata."""
    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2', is)"
        )
    tokens: list[str] = list(field(reader, "tokenizer.ggml.tokens"))
    merges_raw = field(reader, "tokenizer.ggml.merges")
    types = list(field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens):
        raise ModelLoadError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token types")
    merges = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelLoadError(f"GGUF tokenizer merge {m!r} is not 'left right'")
        merges.append((a, b))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelLoadError("GGUF tokenizer vocabulary has duplicate tokens")

    pre_tok, ignore_merges = _pre_tokenizer(field(reader, "tokenizer.ggml.pre", "default"))
    hf = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                         ignore_merges=ignore_merges))
    hf.pre_tokenizer = pre_tok
    hf.decoder = decoders.ByteLevel()
    # Added tokens are matched whole in the raw text (never split by the BPE), as llama.cpp does.
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(tokens, types) if ty == _CONTROL])
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    if hf.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ModelLoadError("GGUF tokenizer: added tokens changed the vocabulary size (inconsistent metadata)")

    def tok_at(key: str) -> str | None:
        i = field(reader, key, None)
        if i is None or not 0 <= int(i) < len(tokens):
            return None
        return tokens[int(i)]

    extra = [int(field(reader, k)) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
             if field(reader, k, None) is not None]
    meta = dict(
        bos_token=tok_at("tokenizer.ggml.bos_token_id"),
        eos_token=tok_at("tokenizer.ggml.eos_token_id"),
        pad_token=tok_at("tokenizer.ggml.padding_token_id"),
        unk_token=tok_at("tokenizer.ggml.unknown_token_id"),
        add_bos=bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=field(reader, "tokenizer.chat_template", None),
        extra_eos_token_ids=extra,
    )
    return hf, meta
