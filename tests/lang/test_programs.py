"""SGLang-style programs on the FakeEngine: few-shot, chat, select, dtype, JSON, loops, fork."""

import json
import re

import msgspec
import pytest

import deepinfer.lang as di
from deepinfer.errors import ProgramError
from deepinfer.lang.choices import resolve_method
from deepinfer.lang.testing import FakeEngine, FakeTokenizer


def test_few_shot_qa_with_stop():
    def respond(prompt, params):
        return " Paris\nQ: and then?" if prompt.endswith("France?\nA:") else None

    eng = FakeEngine(respond=respond)

    @di.function
    def few_shot(s, question):
        s += "Q: What is 1+1?\nA: 2\n"
        s += "Q: What colour is the sky?\nA: blue\n"
        s += "Q: " + question + "\nA:" + di.gen("answer", stop="\n", max_tokens=32)

    st = few_shot.run(question="What is the capital of France?", backend=eng)
    assert st.ok, st.error()
    assert st["answer"] == " Paris"
    assert st.text().endswith("France?\nA: Paris")
    meta = st.get_meta_info("answer")
    assert meta["finish_reason"] == "stop" and meta["stop_reason"] == "\n"
    _, _, params = eng.log[-1]
    assert params.stop == ["\n"] and params.max_tokens == 32


def test_multi_turn_chat_with_role_blocks():
    eng = FakeEngine(respond=lambda p, sp: "Sure." if p.count("<|im_start|>user") == 1 else "Bye.")

    @di.function
    def chat(s):
        with s.system():
            s += "You are terse."
        with s.user():
            s += "Hello"
            s += " world"
        with s.assistant():
            s += di.gen("first", max_tokens=16)
        s += di.user("Second question")
        s += di.assistant(di.gen("second", max_tokens=16))

    st = chat.run(backend=eng)
    assert st.ok, st.error()
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[1]["content"] == "Hello world"
    assert (st["first"], st["second"]) == ("Sure.", "Bye.")
    assert msgs[2]["content"] == "Sure." and msgs[4]["content"] == "Bye."
    # the whole text is exactly what the chat template renders for these messages
    assert st.text() == eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=False)


CHOICES = ["Paris", "Londonderry", "Bern"]
# conditional logprobs per choice token: token-length-normalised favours Londonderry, greedy
# (first token) favours Bern, unconditional normalisation favours Paris (unlikely without context)
COND = {"Paris": [-1.0], "Londonderry": [-0.5, -0.1, -0.1, -0.1, -0.1], "Bern": [-0.2, -3.0, -3.0]}
UNCOND = {"Paris": [-6.0], "Londonderry": [-0.5, -0.1, -0.1, -0.1, -0.1], "Bern": [-0.2, -3.0, -3.0]}


def _choice_logprob_fn(tok):
    ids = {c: tok.encode(c) for c in CHOICES}

    def fn(ctx, t):
        table = UNCOND if len(ctx) < 10 else COND  # unconditional requests are BOS + choice only
        for c, cids in ids.items():
            for j in range(len(cids)):
                if cids[j] == t and (j == 0 or ctx[-j:] == cids[:j]):
                    return table[c][j]
        return -1.0

    return fn


@pytest.mark.parametrize(
    "method,expected",
    [
        (di.token_length_normalized, "Londonderry"),
        (di.greedy_token_selection, "Bern"),
        (di.unconditional_likelihood_normalized, "Paris"),
        ("greedy_token_selection", "Bern"),
    ],
)
def test_select_methods_pick_from_logprobs(method, expected):
    tok = FakeTokenizer(add_bos=True)
    assert [len(tok.encode(c)) for c in CHOICES] == [1, 5, 3]  # Paris | London d er r y | B er n
    eng = FakeEngine(tokenizer=tok, logprob_fn=_choice_logprob_fn(tok))

    @di.function
    def pick(s):
        s += "Which city should we visit? The city is:"
        s += di.select("city", CHOICES, choices_method=method)
        s += " done"

    st = pick.run(backend=eng)
    assert st.ok, st.error()
    assert st["city"] == expected
    assert st.text().endswith(":" + expected + " done")
    n = len(CHOICES) * (2 if resolve_method(method).needs_unconditional else 1)
    assert len(eng.log) == n
    ctx = tok.encode("Which city should we visit? The city is:")
    for (_, prompt, params), c in zip(eng.log, CHOICES):
        assert params.max_tokens == 0 and params.prompt_logprobs == 0
        assert prompt == [tok.bos_token_id] + ctx + tok.encode(c)
        # only the choice tokens need logprobs: the context may come from the prefix cache
        assert getattr(params, "prompt_logprobs_start", len(ctx) + 1) == len(ctx) + 1
    meta = st.get_meta_info("city")
    assert meta["input_token_logprobs"] == [COND[c] for c in CHOICES]


def test_gen_with_choices_is_a_select(engine):
    @di.function
    def pick(s):
        s += "Answer:" + di.gen("yn", choices=["yes", "no"])

    st = pick.run(backend=engine)
    assert st["yn"] in ("yes", "no")
    assert all(p.max_tokens == 0 and p.prompt_logprobs == 0 for _, _, p in engine.log)


def test_dtype_int_float_bool(engine):
    @di.function
    def numbers(s):
        s += "How many? " + di.gen("n", dtype=int)
        s += "\nRatio? " + di.gen("r", dtype=float)
        s += "\nOK? " + di.gen("ok", dtype=bool)
        s["double"] = s["n"] * 2

    st = numbers.run(backend=engine)
    assert st.ok, st.error()
    assert isinstance(st["n"], int) and st["double"] == 2 * st["n"]
    assert isinstance(st["r"], float) and isinstance(st["ok"], bool)
    assert [p.dtype for _, _, p in engine.log] == [int, float, bool]


def test_json_via_per_field_regexes():
    def respond(prompt, params):
        return {r"[A-Z][a-z]+": "Alice", r"[0-9]{1,3}": "31"}.get(params.regex)

    eng = FakeEngine(respond=respond)

    @di.function
    def person(s, text):
        s += "Extract from: " + text + "\n"
        s += '{"name": "' + di.gen("name", regex=r"[A-Z][a-z]+") + '", '
        s += '"age": ' + di.gen("age", regex=r"[0-9]{1,3}") + "}"

    st = person.run(text="Alice is 31.", backend=eng)
    assert st.ok, st.error()
    obj = json.loads(st.text().split("\n", 1)[1])
    assert obj == {"name": "Alice", "age": 31}
    assert [p.regex for _, _, p in eng.log] == [r"[A-Z][a-z]+", r"[0-9]{1,3}"]


class Person(msgspec.Struct):
    name: str
    age: int


@pytest.mark.parametrize("age,asks_why", [(70, True), (30, False)])
def test_json_schema_value_drives_control_flow(age, asks_why):
    def respond(prompt, params):
        if params.json_schema is not None:
            return json.dumps({"name": "Bob", "age": age})
        return "Because."

    eng = FakeEngine(respond=respond)

    @di.function
    def extract(s, text):
        s += di.system("You extract facts.")
        s += di.user("Text: " + text + "\nWho is mentioned?")
        s += di.assistant(di.gen("person", json_schema=Person, max_tokens=96))
        if s["person"].age > 60:
            s += di.user("Why?")
            s += di.assistant(di.gen("why", max_tokens=64, stop="\n"))

    st = extract.run(text="Bob is here.", backend=eng)
    assert st.ok, st.error()
    assert st["person"] == Person("Bob", age)
    assert ("why" in st) is asks_why
    assert len(eng.log) == (2 if asks_why else 1)


def test_tool_use_loop():
    tools = {"weather": "sunny", "time": "noon"}

    def respond(prompt, params):
        n = prompt.count("Observation:")
        return ["CALL weather", "CALL time", "FINAL sunny at noon"][n]

    eng = FakeEngine(respond=respond)

    @di.function
    def agent(s, task):
        s += "Task: " + task + "\n"
        for _ in range(5):
            s += "Step: " + di.gen("step", stop="\n", max_tokens=16) + "\n"
            step = s["step"]
            if step.startswith("FINAL"):
                s["answer"] = step[len("FINAL "):]
                break
            s += "Observation: " + tools[step.split()[1]] + "\n"

    st = agent.run(task="weather report", backend=eng)
    assert st.ok, st.error()
    assert st["answer"] == "sunny at noon"
    assert len(eng.log) == 3
    assert "Observation: sunny\n" in st.text() and "Observation: noon\n" in st.text()


def test_react_loop_following_select():
    tok = FakeTokenizer()
    search, finish = tok.encode("search"), tok.encode("finish")

    def lp(ctx, t):
        observations = tok.decode(ctx).count("Observation:")
        if t == search[0]:
            return -0.1 if observations < 2 else -5.0
        if t == finish[0]:
            return -5.0 if observations < 2 else -0.1
        return -1.0

    eng = FakeEngine(tokenizer=tok, logprob_fn=lp)

    @di.function
    def react(s, question):
        s += "Question: " + question + "\n"
        for i in range(6):
            s += "Thought: " + di.gen(f"thought{i}", max_tokens=8, stop="\n") + "\n"
            s += "Action: " + di.select("action", ["search", "finish"]) + "\n"
            if s["action"] == "finish":
                break
            s += f"Observation: result {i}\n"
        s["steps"] = i + 1

    st = react.run(question="Who?", backend=eng)
    assert st.ok, st.error()
    assert st["steps"] == 3 and st["action"] == "finish"
    assert st.text().count("Action: search") == 2


def test_fork_join_gathers_variables():
    eng = FakeEngine(respond=lambda p, sp: f"idea{p.rsplit('Option ', 1)[1][0]}" if "Option " in p else None,
                     tokens_per_step=1)

    @di.function
    def brainstorm(s):
        s += "Topic: cities.\n"
        forks = s.fork(5)
        for i, f in enumerate(forks):
            f += f"Option {i}: " + di.gen("idea", max_tokens=8)
        assert forks["idea"] == [f"idea{i}" for i in range(5)]
        s.join(forks)
        s += "Best: " + di.gen("best", max_tokens=4)

    st = brainstorm.run(backend=eng)
    assert st.ok, st.error()
    assert st["idea"] == [f"idea{i}" for i in range(5)]
    assert len(st.get_meta_info("idea")) == 5
    assert eng.max_running == 5  # the five children's requests ran in one engine batch
    parent_ids = eng.tokenizer.encode("Topic: cities.\n")
    assert all(p[: len(parent_ids)] == parent_ids for _, p, _ in eng.log[:5])
    assert st.text().startswith("Topic: cities.\nBest: ")  # gather mode leaves the parent's text alone


def test_fork_group_concat_join(engine):
    @di.function
    def prog(s):
        s += "Start."
        forks = s.fork(2)
        forks += " child" + di.gen("x", max_tokens=2)
        forks.join(mode="concat")

    st = prog.run(backend=engine)
    assert st.ok, st.error()
    assert st.text() == "Start." + "".join(" child" + x for x in st["x"])


def test_generated_value_builds_next_prompt():
    eng = FakeEngine(respond=lambda p, sp: "Paris" if p.endswith("City:") else None)

    @di.function
    def prog(s):
        s += "City:" + di.gen("city", max_tokens=4)
        s += "\nThe population of " + s["city"].upper() + " is" + di.gen("pop", max_tokens=4)

    st = prog.run(backend=eng)
    assert st.ok, st.error()
    assert "The population of PARIS is" in eng.tokenizer.decode(eng.log[1][1])


def test_nested_function_call_runs_inline(engine):
    @di.function
    def greet(s, name):
        s += "Hello " + name + ". " + di.gen("greeting", max_tokens=3)

    @di.function
    def outer(s):
        greet(s, "Bob")
        s += " Bye"

    st = outer.run(backend=engine)
    assert st.ok and st.text().startswith("Hello Bob. ") and "greeting" in st


def test_role_misuse_is_a_program_error(engine):
    @di.function
    def bad(s):
        with s.user():
            s += di.assistant("nested")

    st = bad.run(backend=engine)
    assert not st.ok and isinstance(st.error(), ProgramError)
    assert "assistant" in str(st.error()) and "user" in str(st.error())


def test_return_logprob_in_meta(engine):
    @di.function
    def prog(s):
        s += "Hi" + di.gen("a", max_tokens=5, return_logprob=True)

    st = prog.run(backend=engine)
    meta = st.get_meta_info("a")
    assert len(meta["logprobs"]) == meta["completion_tokens"] == 5
    assert all(isinstance(x, float) for x in meta["logprobs"])


def test_run_defaults_are_overridden_by_gen(engine):
    @di.function
    def prog(s):
        s += "a" + di.gen("x")
        s += "b" + di.gen("y", max_tokens=5, temperature=0.7)

    st = prog.run(backend=engine, max_tokens=3, temperature=0.0)
    assert st.ok
    (_, _, p1), (_, _, p2) = engine.log
    assert (p1.max_tokens, p1.temperature) == (3, 0.0)
    assert (p2.max_tokens, p2.temperature) == (5, 0.7)


def test_set_default_backend():
    eng = FakeEngine()
    di.set_default_backend(eng)
    try:
        @di.function
        def prog(s):
            s += "x" + di.gen("y", max_tokens=2)

        assert prog.run().ok and len(eng.log) == 1
    finally:
        di.set_default_backend(None)


def test_regex_output_is_text(engine):
    @di.function
    def prog(s):
        s += "Date: " + di.gen("d", regex=r"\d{4}-\d{2}-\d{2}")

    st = prog.run(backend=engine)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", st["d"])
