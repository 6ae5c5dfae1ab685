"""The runtime: batching, windows, errors, prefix sharing, asyncio, streaming, token-level state."""

import asyncio
import threading
import time

import pytest

import deepinfer.lang as di
from deepinfer.errors import GrammarError, InvalidRequestError, ProgramError
from deepinfer.lang.runtime import get_runtime
from deepinfer.lang.testing import FakeEngine

SYSTEM = "You are a careful assistant. Answer every question with one short sentence and nothing else."


@di.function
def echo(s, i):
    if i % 7 == 3:
        raise ValueError(f"program {i} fails on purpose")
    s += di.system(SYSTEM)
    s += di.user(f"Number {i}")
    s += di.assistant(di.gen("out", max_tokens=8))


def _echo_engine(**kw):
    return FakeEngine(respond=lambda p, sp: "n" + p.rsplit("Number ", 1)[1].split("<")[0], **kw)


def test_run_batch_1000_with_failures_keeps_order():
    eng = _echo_engine()
    states = echo.run_batch([{"i": i} for i in range(1000)], backend=eng, max_in_flight=64)
    assert len(states) == 1000
    for i, st in enumerate(states):
        if i % 7 == 3:
            assert not st.ok and isinstance(st.error(), ValueError) and f"program {i}" in str(st.error())
        else:
            assert st.ok, st.error()
            assert st["out"] == f"n{i}"
    assert sum(p.max_tokens > 0 for _, _, p in eng.log) == sum(1 for i in range(1000) if i % 7 != 3)


def test_window_bounds_programs_in_flight():
    eng = _echo_engine(tokens_per_step=1)
    states = echo.run_batch([{"i": i} for i in range(1, 200, 7)] * 4, backend=eng, max_in_flight=8,
                            share_prefix=False)
    assert all(st.ok for st in states)
    assert eng.max_running == 8  # the window was both filled and never exceeded
    assert get_runtime(eng).stats.max_active_programs == 8


def test_static_prefix_submitted_once():
    eng = _echo_engine()
    states = echo.run_batch([{"i": i} for i in range(0, 300, 7)], backend=eng, share_prefix=True)
    assert all(st.ok for st in states)
    prefill_only = [(rid, p) for rid, p, sp in eng.log if sp.max_tokens == 0]
    assert len(prefill_only) == 1
    assert eng.log[0][0] == prefill_only[0][0]  # it went first ...
    prefix = prefill_only[0][1]
    tok = eng.tokenizer
    rendered = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Number "}])
    assert tok.decode(prefix, skip_special_tokens=False) == rendered.split("Number ")[0] + "Number "
    for _, p, sp in eng.log[1:]:  # ... and every program's prompt extends it and hits the cache
        assert p[: len(prefix)] == prefix
    assert all(st.get_meta_info("out")["num_cached_tokens"] >= len(prefix) - eng.cache_block for st in states)


def test_share_prefix_off_sends_no_prefill_request():
    eng = _echo_engine()
    echo.run_batch([{"i": i} for i in range(0, 100, 7)], backend=eng, share_prefix=False)
    assert all(sp.max_tokens > 0 for _, _, sp in eng.log)


def test_submission_errors_are_captured_per_program():
    eng = FakeEngine()

    @di.function
    def prog(s, regex, temperature):
        s += "x: " + di.gen("x", regex=regex, temperature=temperature, max_tokens=4)

    states = prog.run_batch(
        [{"regex": "[", "temperature": 0.0}, {"regex": r"\d+", "temperature": -1.0}, {"regex": r"\d+", "temperature": 0.0}],
        backend=eng,
    )

    @di.function
    def schema_prog(s):
        s += "x: " + di.gen("x", json_schema="{not json")

    bad_schema = schema_prog.run(backend=eng)
    assert isinstance(bad_schema.error(), GrammarError) and "JSON" in str(bad_schema.error())
    assert isinstance(states[0].error(), GrammarError)
    assert isinstance(states[1].error(), InvalidRequestError) and "temperature" in str(states[1].error())
    assert states[2].ok and states[2]["x"] == "42"


def test_caller_errors_raise_immediately(engine):
    with pytest.raises(InvalidRequestError, match="item 1"):
        echo.run_batch([{"i": 1}, 5], backend=engine)
    with pytest.raises(InvalidRequestError, match="temperature"):
        echo.run_batch([{"i": 1}], backend=engine, temperature=-3.0)
    with pytest.raises(InvalidRequestError, match="max_in_flight"):
        echo.run_batch([{"i": 1}], backend=engine, max_in_flight=0)
    with pytest.raises(InvalidRequestError, match="non-empty"):
        di.select("x", [])


def test_bad_arguments_are_captured(engine):
    st = echo.run(backend=engine, j=3)
    assert isinstance(st.error(), TypeError)


def test_run_inside_program_is_refused(engine):
    @di.function
    def inner(s):
        s += "x"

    @di.function
    def outer(s):
        inner.run(backend=engine)

    st = outer.run(backend=engine)
    assert isinstance(st.error(), ProgramError) and "directly" in str(st.error())


def test_engine_error_output_fails_only_that_program():
    class ErrorEngine(FakeEngine):
        def step(self):
            outs = super().step()
            for o in outs:
                if o.finished and "poison" in self.tokenizer.decode(o.prompt_token_ids):
                    o.finish_reason, o.error = "error", "boom"
            return outs

    eng = ErrorEngine()

    @di.function
    def prog(s, word):
        s += word + di.gen("x", max_tokens=3)

    good, bad = prog.run_batch([{"word": "fine"}, {"word": "poison"}], backend=eng)
    assert good.ok
    assert isinstance(bad.error(), ProgramError) and "boom" in str(bad.error())


def test_failing_program_aborts_its_requests_in_flight():
    eng = FakeEngine(tokens_per_step=1)

    @di.function
    def prog(s):
        s += "go"
        forks = s.fork(2)
        forks[0] += di.gen("short", max_tokens=2)
        forks[1] += di.gen("long", max_tokens=50)
        forks[0]["short"]
        raise RuntimeError("stop now")

    st = prog.run(backend=eng)
    assert isinstance(st.error(), RuntimeError)
    long_rid = [rid for rid, _, sp in eng.log if sp.max_tokens == 50][0]
    assert eng.aborted == [long_rid]
    assert not eng.has_unfinished()


def test_arun_gather_batches_together():
    class SlowEngine(FakeEngine):
        def step(self):
            time.sleep(0.002)  # give every coroutine time to submit before the first finishes
            return super().step()

    eng = SlowEngine(respond=lambda p, sp: "n" + p.rsplit("Number ", 1)[1].split("<")[0], tokens_per_step=1)

    async def main():
        return await asyncio.gather(*[echo.arun(i=i, backend=eng) for i in range(0, 140, 7)])

    states = asyncio.run(main())
    assert [st["out"] for st in states] == [f"n{i}" for i in range(0, 140, 7)]
    assert eng.max_running >= 10


def test_streaming_text_iter():
    eng = FakeEngine(respond=lambda p, sp: "one two three four five six", tokens_per_step=1)

    @di.function
    def prog(s):
        s += di.user("Count")
        s += di.assistant(di.gen("count", max_tokens=32))

    st = prog.run(backend=eng, stream=True)
    pieces = list(st.text_iter("count"))
    assert len(pieces) > 3 and "".join(pieces) == "one two three four five six"
    assert "".join(st.text_iter()) == st.text()
    assert st["count"] == "".join(pieces)


def test_text_iter_on_finished_state(engine):
    @di.function
    def prog(s):
        s += "a" + di.gen("x", max_tokens=3)

    st = prog.run(backend=engine)
    assert list(st.text_iter()) == [st.text()]
    assert "".join(st.text_iter("x")) == st["x"]


def test_progress_bar(engine, capsys):
    states = echo.run_batch([{"i": i} for i in (1, 2)], backend=engine, progress_bar=True)
    assert all(st.ok for st in states)
    assert "2/2" in capsys.readouterr().err


def test_bounded_threads_for_large_batch():
    eng = _echo_engine()
    before = threading.active_count()
    echo.run_batch([{"i": i} for i in range(0, 3000, 7)], backend=eng, max_in_flight=32)
    assert threading.active_count() <= before + 1  # just the runtime thread of this engine


# ---------------------------------------------------------------------- token-level state
def test_prompts_are_token_ids_of_the_template_rendering():
    eng = FakeEngine(respond=lambda p, sp: "Hello there")
    tok = eng.tokenizer

    @di.function
    def chat(s):
        s += di.system("Be brief.")
        with s.user():
            s += "What is"
            s += " the capital of France?"  # pieces tokenise together, as in the rendering
        s += di.assistant(di.gen("a1", max_tokens=8))
        s += di.user("And of Germany?")
        s += di.assistant(di.gen("a2", max_tokens=8))

    st = chat.run(backend=eng)
    assert st.ok, st.error()
    msgs = st.messages()
    for (_, prompt, _), upto in zip(eng.log, (2, 4)):
        assert isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        assert prompt == tok.encode(tok.apply_chat_template(msgs[:upto], add_generation_prompt=True))
    assert st.token_ids() == tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=False))
    assert tok.encode(" the")[0] in eng.log[0][1]  # merged across the two appends


def test_generated_ids_are_kept_exactly():
    # the engine emits one token per byte: re-tokenising the text would merge "Hello" into one token
    eng = FakeEngine(respond=lambda p, sp: "Hello world", byte_level_output=True)
    tok = eng.tokenizer

    @di.function
    def prog(s):
        s += "Say:" + di.gen("a", max_tokens=20)
        s += " Again:" + di.gen("b", max_tokens=20)

    st = prog.run(backend=eng)
    assert st.ok, st.error()
    second = eng.log[1][1]
    assert second == tok.encode("Say:") + list(b"Hello world") + tok.encode(" Again:")


def test_stop_string_tokens_are_trimmed():
    eng = FakeEngine(respond=lambda p, sp: "Paris\nextra" if p.endswith("A:") else "ok")
    tok = eng.tokenizer

    @di.function
    def prog(s):
        s += "A:" + di.gen("a", stop="\n", max_tokens=20)
        s += " B:" + di.gen("b", max_tokens=5)

    st = prog.run(backend=eng)
    assert st["a"] == "Paris"
    assert eng.log[1][1] == tok.encode("A:") + tok.encode("Paris") + tok.encode(" B:")
    assert st.text() == "A:Paris B:ok"


def test_ten_thousand_programs_bounded_window():
    eng = FakeEngine(respond=lambda p, sp: "ok", tokens_per_step=8)

    @di.function
    def tiny(s, i):
        s += f"Item {i}:" + di.gen("v", max_tokens=2)

    before = threading.active_count()
    states = tiny.run_batch([{"i": i} for i in range(10_000)], backend=eng, max_in_flight=256, share_prefix=False)
    assert threading.active_count() <= before + 1
    assert get_runtime(eng).stats.max_active_programs == 256 and eng.max_running == 256
    assert all(st.ok for st in states) and states[9_999].text() == "Item 9999:ok"


def test_concurrent_callers_share_one_runtime_thread():
    eng = _echo_engine(tokens_per_step=1)
    results = {}

    def worker(k):
        results[k] = [echo.run(i=7 * k + j, backend=eng)["out"] for j in (1, 2)]

    before = threading.active_count()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {k: [f"n{7 * k + 1}", f"n{7 * k + 2}"] for k in range(4)}
    assert threading.active_count() <= before + 1


def test_long_lived_objects_are_frozen_out_of_the_cyclic_gc_only_while_batches_run():
    import gc

    seen = []

    @di.function
    def one(s, i):
        s += f"Item {i}: " + di.gen("x", max_tokens=2)
        if isinstance(s, di.ProgramState):  # the real run, not the compiler's trace
            seen.append(gc.get_freeze_count())

    assert gc.get_freeze_count() == 0
    states = one.run_batch([{"i": i} for i in range(3)], backend=FakeEngine(), temperature=0.0)
    assert all(st.ok for st in states)
    assert len(seen) == 3 and min(seen) > 0  # the engine and modules were frozen during the batch
    assert gc.get_freeze_count() == 0  # and handed back to the collector when it ended
