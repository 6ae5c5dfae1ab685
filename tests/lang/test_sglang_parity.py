"""SGLang API names that port with renames only (README table), on the FakeEngine."""

import asyncio
import math

import pytest

import deepinfer as di
from deepinfer.errors import InvalidRequestError
from deepinfer.lang.testing import FakeEngine


def test_gen_int_and_gen_string(engine):
    @di.function
    def prog(s):
        s += "Count: " + di.gen_int("n", max_tokens=6)
        s += "\nName: " + di.gen_string("who", max_tokens=10)

    st = prog.run(backend=engine, temperature=0.0)
    assert st.ok, st.error()
    assert isinstance(st["n"], int) and isinstance(st["who"], str)
    params = [p for _, _, p in engine.log]
    assert params[0].dtype is int and params[1].dtype is str


def test_gen_n_samples_share_the_prompt_and_leave_the_text():
    eng = FakeEngine()

    @di.function
    def prog(s):
        s += "Idea:" + di.gen("idea", n=3, max_tokens=4, temperature=0.9, seed=7)
        s += " end"

    st = prog.run(backend=eng)
    assert st.ok, st.error()
    assert isinstance(st["idea"], list) and len(st["idea"]) == 3
    assert st.text() == "Idea: end"
    prompts = {tuple(ids) for _, ids, _ in eng.log}
    assert len(prompts) == 1 and [p.seed for _, _, p in eng.log] == [7, 8, 9]
    metas = st.get_meta_info("idea")
    assert [m["text"] for m in metas] == st["idea"]
    with pytest.raises(InvalidRequestError, match="n must be"):
        di.gen("x", n=0)


def test_logprob_options_map_onto_engine_logprobs(engine):
    @di.function
    def prog(s):
        s += "The answer is" + di.gen("a", max_tokens=3, top_logprobs_num=2, return_text_in_logprobs=True,
                                      logprob_start_len=2)

    st = prog.run(backend=engine, temperature=0.0)
    assert st.ok, st.error()
    p = engine.log[0][2]
    assert p.logprobs == 2 and p.prompt_logprobs == 2 and p.prompt_logprobs_start == 2
    meta = st.get_meta_info("a")
    assert len(meta["logprob_tokens"]) == meta["completion_tokens"]
    assert "".join(meta["logprob_tokens"]).strip() == st["a"].strip()
    assert len(meta["logprobs"]) == meta["completion_tokens"]


def test_select_temperature(engine):
    @di.function
    def prog(s, t, seed):
        s += "Pick: " + di.select("c", ["yes", "no", "maybe"], temperature=t, seed=seed)

    best = prog.run(backend=engine, t=0.0, seed=None)
    assert best.ok and "choice_probs" not in best.get_meta_info("c")
    states = prog.run_batch([{"t": 5.0, "seed": k} for k in range(300)], backend=engine)
    assert all(st.ok for st in states)
    meta = states[0].get_meta_info("c")
    scores = meta["normalized_prompt_logprobs"]
    z = [math.exp(x / 5.0) for x in scores]
    want = [w / sum(z) for w in z]
    assert meta["choice_probs"] == pytest.approx(want)
    freq = [sum(st["c"] == c for st in states) / len(states) for c in ("yes", "no", "maybe")]
    assert freq == pytest.approx(want, abs=0.09)  # 300 draws: ~3 standard deviations
    again = prog.run_batch([{"t": 5.0, "seed": k} for k in range(20)], backend=engine)
    assert [st["c"] for st in again] == [st["c"] for st in states[:20]]  # a seed always draws the same
    for bad in (-1.0, float("inf"), "hot", True):
        with pytest.raises(InvalidRequestError, match="temperature"):
            di.select("c", ["yes", "no"], temperature=bad)


def test_sample_choice_frequencies():
    from deepinfer.lang.choices import sample_choice

    picks = [sample_choice([0.0, math.log(3.0), float("-inf")], 1.0, seed)[0] for seed in range(4000)]
    assert picks.count(2) == 0
    assert picks.count(1) / len(picks) == pytest.approx(0.75, abs=0.03)


def test_copy_and_var_scope(engine):
    @di.function
    def prog(s):
        s += "Start. "
        with s.var_scope("middle"):
            s += "Hello " + di.gen("w", max_tokens=2)
        c = s.copy()
        c += " child only"
        s["child_text"] = c.text()

    st = prog.run(backend=engine, temperature=0.0)
    assert st.ok, st.error()
    assert st["middle"] == "Hello " + st["w"]
    assert st["child_text"] == st.text() + " child only"
    assert "child only" not in st.text()


def test_text_async_iter(engine):
    @di.function
    def prog(s):
        s += "Story:" + di.gen("story", max_tokens=12)

    async def main():
        st = prog.run(backend=engine, stream=True, temperature=0.0)
        return st, [piece async for piece in st.text_async_iter("story")]

    st, pieces = asyncio.run(main())
    assert st.ok and "".join(pieces) == st["story"] and len(pieces) >= 1
