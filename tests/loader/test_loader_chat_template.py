"""Chat template rendering: SmolLM2's own template from the GGUF, plus hand-written templates."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import models

from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.errors import InvalidRequestError

SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _tiny(template: str | None, **kw) -> Tokenizer:
    hf = tokenizers.Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    return Tokenizer(hf, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=template, **kw)


def test_smollm2_renders_chatml_with_default_system(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    assert text == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_smollm2_user_system_and_no_generation_prompt(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    assert SMOL_SYSTEM not in text


def test_smollm2_matches_transformers_rendering(tok, hf_gguf_tokenizer):
    msgs = [{"role": "user", "content": "Write a haiku about 日本."}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "again"}]
    ref = hf_gguf_tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs) == ref


def test_text_content_parts_are_joined(tok):
    a = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                              {"type": "text", "text": "there"}]}])
    b = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert a == b


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], "message 0 must be a dict"),
        ([{"content": "x"}], "message 0 has no 'role'"),
        ([{"role": None, "content": "x"}], "message 0 has no 'role'"),
        # a non-string role was reported as missing; an unknown one was rendered as a turn header
        ([{"role": 5, "content": "x"}], r"message 0: 'role' must be a string, got 5 \(int\)"),
        ([{"role": "user", "content": "a"}, {"role": "assitant", "content": "b"}],
         r"message 1 has unknown role 'assitant'; expected one of system, user, assistant, tool"),
        ([{"role": "", "content": "x"}], "message 0 has unknown role ''"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "message 1 .*has no 'content'"),
        ([{"role": "user", "content": 5}], "'content' must be a string"),
        ([{"role": "user", "content": None}], "content None"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text content"),
    ],
)
def test_bad_messages_raise_invalid_request(tok, messages, match):
    with pytest.raises(InvalidRequestError, match=match):
        tok.apply_chat_template(messages)


def test_every_known_role_reaches_the_template():
    t = _tiny("{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}")
    msgs = [{"role": r, "content": r[0]} for r in ("system", "user", "assistant", "tool")]
    assert t.apply_chat_template(msgs) == "system=s;user=u;assistant=a;tool=t;"


def test_raise_exception_in_template_becomes_invalid_request():
    t = _tiny("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}"
              "{% endif %}{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"
    with pytest.raises(InvalidRequestError, match="first message must be user"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_tools_and_extra_variables_reach_the_template():
    t = _tiny("{% if tools %}{{ tools | tojson }}|{% endif %}{{ enable_thinking }}|"
              "{% for m in messages %}{{ m.role }}{% endfor %}")
    out = t.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"name": "f→g"}], enable_thinking=False)
    assert out == '[{"name": "f→g"}]|False|user'  # tojson keeps non-ASCII, like HF templates expect
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "|user"  # tools=None, unset variable


def test_template_is_sandboxed():
    t = _tiny("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_is_a_clear_error():
    with pytest.raises(InvalidRequestError, match="no chat template"):
        _tiny(None).apply_chat_template([{"role": "user", "content": "x"}])
