"""Tokenizer.from_dir across the tokenizer_config.json dialects found in HF repos."""

from __future__ import annotations

import json

import pytest

from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.errors import ModelLoadError


def _write(d, tiny_tok, **cfg):
    tiny_tok.hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


def test_added_token_dicts_and_named_templates(tiny_tok, tmp_path):
    _write(tmp_path, tiny_tok,
           bos_token={"content": "<|im_start|>", "special": True, "__type": "AddedToken"},
           eos_token={"content": "<|im_end|>"}, pad_token=None,
           chat_template=[{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}])
    t = Tokenizer.from_dir(tmp_path)
    assert t.bos_token_id == tiny_tok.token_to_id("<|im_start|>")
    assert t.eos_token_ids[0] == tiny_tok.token_to_id("<|im_end|>")
    assert t.pad_token_id is None
    assert t.chat_template == "DEFAULT"


def test_chat_template_jinja_file_wins(tiny_tok, tmp_path):
    _write(tmp_path, tiny_tok, eos_token="<|im_end|>", chat_template="OLD")
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}<|im_end|>")
    t = Tokenizer.from_dir(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey<|im_end|>"


def test_add_bos_inferred_from_post_processor(tiny_tok, tmp_path):
    from tokenizers import processors

    bos = "<|im_start|>"
    hf = tiny_tok.hf
    saved = hf.post_processor
    hf.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    try:
        _write(tmp_path, tiny_tok, bos_token=bos, eos_token="<|im_end|>")  # no add_bos_token key
    finally:
        hf.post_processor = saved
    t = Tokenizer.from_dir(tmp_path)
    assert t.add_bos is True
    assert t.encode("the", add_special_tokens=True) == [1] + t.encode("the")
    assert t.encode("the") == tiny_tok.encode("the")  # plain encode never adds BOS


def test_generation_config_eos_ids_are_added(tiny_tok, tmp_path):
    _write(tmp_path, tiny_tok, eos_token="<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids[0] == 2 and 5 in t.eos_token_ids


def test_no_end_of_turn_tokens_without_template(tiny_tok, tmp_path):
    _write(tmp_path, tiny_tok, eos_token="<|im_start|>")
    t = Tokenizer.from_dir(tmp_path)
    # <|im_end|> is not EOS here: nothing says it ends a turn (no template, not the eos token)
    assert tiny_tok.token_to_id("<|im_end|>") not in t.eos_token_ids


def test_bad_tokenizer_config(tiny_tok, tmp_path):
    tiny_tok.hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="must hold a JSON object"):
        Tokenizer.from_dir(tmp_path)
