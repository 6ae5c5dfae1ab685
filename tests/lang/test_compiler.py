"""The program compiler: trace -> graph, ahead-of-time checks, batch plan (prefix, compiles)."""

import re

import pytest

import deepinfer as di
from deepinfer.errors import InvalidRequestError
from deepinfer.lang import ProgramCheckError
from deepinfer.lang.compiler import static_prefix, varying_arguments
from deepinfer.lang.runtime import get_runtime
from deepinfer.lang.testing import FakeEngine

SYSTEM = "You are a careful assistant. Answer in one short sentence, and name the city."


@di.function
def three_stage(s, doc, n_words=4):
    s += di.system(SYSTEM)
    s += di.user("Extract the place from: " + doc)
    s += di.assistant(di.gen("place", max_tokens=8, stop="\n"))
    s += di.user("Is " + s["place"] + " a capital?")
    s += di.assistant(di.select("capital", ["yes", "no"]))
    if s["capital"] == "yes":  # control flow on a generated value: the trace ends here
        s += di.user("Which country?")
        s += di.assistant(di.gen("country", max_tokens=n_words))


def test_trace_records_nodes_dependencies_and_break():
    g = three_stage.trace("Alice lives in Paris.")
    kinds = [n.kind for n in g.nodes]
    assert kinds[:4] == ["role_begin", "text", "role_end", "role_begin"]
    assert "gen" in kinds and "select" in kinds and kinds[-1] == "break"
    assert "capital" in g.broken.text and g.broken.line is not None
    by_kind = {n.kind: n for n in g.nodes}
    system_text = g.nodes[1]
    assert system_text.text == SYSTEM and not system_text.args  # static
    doc_text = next(n for n in g.nodes if n.kind == "text" and "Extract" in n.text)
    assert doc_text.args == {"doc"} and doc_text.arg_offset == len("Extract the place from: ")
    read_text = next(n for n in g.nodes if n.kind == "text" and n.reads)
    assert read_text.reads == ("place",)
    gen = next(n for n in g.nodes if n.kind == "gen")
    sel = by_kind["select"]
    assert gen.id in sel.deps  # the select's prompt reads the generated place
    assert gen.category() == "generated" and system_text.category() == "static"
    assert doc_text.category() == "argument" and doc_text.category(varying=set()) == "static"
    # the gen after the break is not in the graph (it runs interpreted)
    assert all(n.name != "country" for n in g.nodes)


def test_graph_text_and_dot():
    text = three_stage.graph("Alice lives in Paris.")
    assert "program three_stage(doc, n_words)" in text and "break:" in text and "reads=place" in text
    dot = three_stage.graph("Alice lives in Paris.", format="dot")
    assert dot.startswith('digraph "three_stage"') and "#dddddd" in dot and "#ffe599" in dot
    assert "#b6d7a8" in dot and "#ea9999" in dot and "style=dashed" in dot
    with pytest.raises(InvalidRequestError, match="format"):
        three_stage.graph("x", format="svg")


def test_argument_used_in_sampling_and_in_loop_bounds():
    @di.function
    def loops(s, k, tokens):
        s += "Header text that is static.\n"
        for i in range(k):
            s += f"Item {i}:" + di.gen(f"x{i}", max_tokens=tokens)

    g = loops.trace(2, 5)
    gens = [n for n in g.nodes if n.kind == "gen"]
    assert len(gens) == 2 and all("tokens" in n.args for n in gens)
    assert not g.nodes[0].args  # the header depends on nothing
    # k changes the number of nodes, not the content of the traced ones
    assert g.shape_args == {"k"} and not any("k" in n.args for n in g.nodes)
    assert "node count depends on: k" in g.to_text()


def test_fork_join_traced():
    @di.function
    def fan(s, topic):
        s += "Ideas about " + topic + ":"
        f = s.fork(3)
        for i, b in enumerate(f):
            b += di.gen("idea", max_tokens=4, seed=i)
        f.join()
        s += "Best: " + di.gen("best", max_tokens=4)

    g = fan.trace("tea")
    forks = [n for n in g.nodes if n.kind == "fork"]
    joins = [n for n in g.nodes if n.kind == "join"]
    gens = [n for n in g.nodes if n.kind == "gen" and n.name == "idea"]
    assert len(forks) == 1 and len(joins) == 1 and len(gens) == 3
    assert len({n.branch for n in gens}) == 3 and sorted(joins[0].deps) == [n.id for n in gens]
    assert not any(n.deps for n in gens)  # the three fork gens read nothing of each other


@pytest.mark.parametrize(
    "body, match",
    [
        (lambda s: s.__iadd__("x" + s["nope"]), "reads variable 'nope'"),
        (lambda s: s.__iadd__(di.select("a", [])), "select needs"),
        (lambda s: s.__iadd__(di.gen("a", regex="[")), "regex"),
        (lambda s: s.__iadd__(di.gen("a", regex="[^\\s\\S]")), "matches no string"),
        (lambda s: s.__iadd__(di.gen("a", json_schema="{not json")), "JSON"),
        (lambda s: s.__iadd__(di.gen("a", bogus_arg=3)), "unknown sampling argument"),
        (lambda s: s.__iadd__(di.gen("a", temperature=-1.0)), "temperature"),
    ],
)
def test_ahead_of_time_checks_name_the_line(body, match):
    def prog(s):
        s += "Q: "
        body(s)

    f = di.function(prog)
    with pytest.raises(ProgramCheckError, match=match) as info:
        f.check()
    # the location once: an undefined variable's message used to carry its own "line N: " too
    assert len(re.findall(r"\bline \d+:", str(info.value))) == 1, str(info.value)


def test_check_passes_a_good_program_and_uses_run_defaults():
    three_stage.check("Alice lives in Paris.")
    # a run-level default valid alone but not with the gen's own max_tokens=8
    with pytest.raises(ProgramCheckError, match="min_tokens"):
        three_stage.check("x", min_tokens=20)


def test_varying_arguments_and_static_prefix():
    jobs = [((), {"doc": f"doc {i}", "n_words": 4}) for i in range(3)]
    assert varying_arguments(three_stage.func, jobs) == {"doc"}
    g = three_stage.trace("doc 0", 4)
    leaves = static_prefix(g, {"doc"})
    text = "".join(getattr(x, "text", "") for x in leaves)
    assert text.endswith("Extract the place from: ") and SYSTEM in text
    assert repr(static_prefix(g, {"doc", "n_words"})) == repr(leaves)  # n_words is only read after the break


def _bound_varying(func, jobs):
    """varying_arguments through inspect's bind only (the fast keyword path disabled)."""
    import deepinfer.lang.compiler as comp

    fast = comp._varying_keywords
    comp._varying_keywords = lambda *a: None
    try:
        return varying_arguments(func, jobs)
    finally:
        comp._varying_keywords = fast


def test_varying_arguments_keyword_fast_path_equals_binding():
    import random

    rng = random.Random(7)

    def prog(s, a, b=1, c="x"):
        pass

    values = {"a": [0, 0.0, 1, "1", None], "b": [1, 1, 2, True], "c": ["x", "x", "y"]}
    for _ in range(300):
        jobs = []
        for _ in range(rng.randint(1, 5)):
            kw = {k: rng.choice(v) for k, v in values.items() if rng.random() < 0.8}
            if rng.random() < 0.1:
                kw["unknown"] = 1  # not a parameter: the fast path hands back to bind
            jobs.append(((), kw))
        assert varying_arguments(prog, jobs) == _bound_varying(prog, jobs), jobs
    # positional jobs and **kwargs programs take the binding path
    assert varying_arguments(prog, [((1,), {}), ((2,), {})]) == {"a"}
    assert varying_arguments(three_stage.func, [((), {"doc": "x"}), ((), {"doc": "x", "n_words": 4})]) == {"n_words"}


def test_compiled_batch_prefills_static_prefix_once_and_matches_interpreted():
    docs = [f"Person {i} lives in Paris, France, since {1990 + i}." for i in range(6)]
    results = {}
    for compile_ in (False, True):
        eng = FakeEngine()
        states = three_stage.run_batch([{"doc": d} for d in docs], backend=eng, temperature=0.0, compile=compile_)
        assert all(st.ok for st in states), [st.error() for st in states]
        results[compile_] = [(st.text(), st.variables()) for st in states]
        rt = get_runtime(eng)
        assert rt.stats.prefix_requests == 1
        prefix_ids = next(ids for _, ids, p in eng.log if p.max_tokens == 0)
        assert eng.tokenizer.decode(prefix_ids, skip_special_tokens=False).startswith("<|im_start|>system\n" + SYSTEM)
    assert results[True] == results[False]


def test_compiled_prefix_extends_into_the_common_start_of_the_varying_argument():
    # the docs vary but share a start: the compiled plan prefills through it, as much as the
    # interpreted runtime's collected prefix does, and the states stay identical
    docs = [f"Traveller from the far north, number {i}, lives in Paris." for i in range(6)]
    prefixes, results = {}, {}
    for compile_ in (False, True):
        eng = FakeEngine()
        states = three_stage.run_batch([{"doc": d} for d in docs], backend=eng, temperature=0.0, compile=compile_)
        assert all(st.ok for st in states), [st.error() for st in states]
        results[compile_] = [(st.text(), st.variables()) for st in states]
        prefixes[compile_] = next(ids for _, ids, p in eng.log if p.max_tokens == 0)
    assert results[True] == results[False]
    text = FakeEngine().tokenizer.decode(prefixes[True], skip_special_tokens=False)
    assert "Extract the place from: Traveller from the far north, number" in text
    assert len(prefixes[True]) >= len(prefixes[False])
    assert prefixes[True] == prefixes[False][:len(prefixes[True])]


def test_batch_prefix_extends_only_through_a_verbatim_argument():
    from deepinfer.lang.compiler import argument_values, batch_prefix

    @di.function
    def verbatim(s, doc, tag="x"):
        s += "Head. " + doc + " [" + tag + "]" + di.gen("a", max_tokens=2)

    @di.function
    def shouted(s, doc):
        s += "Head. " + doc.upper() + di.gen("a", max_tokens=2)

    jobs = [((), {"doc": "same start A"}), ((), {"doc": "same start B"})]
    g = verbatim.trace(doc="same start A")
    vals = argument_values(verbatim.func, jobs, {"doc"})
    assert [x.text for x in batch_prefix(g, {"doc"}, vals)] == ["Head. same start "]
    assert [x.text for x in static_prefix(g, {"doc"})] == ["Head. "]
    # positional jobs bind to the same values
    assert argument_values(verbatim.func, [(("same start A",), {}), (("same start B",), {})], {"doc"}) == vals
    # the text does not hold the value verbatim: no extension
    g2 = shouted.trace(doc="same start A")
    assert [x.text for x in batch_prefix(g2, {"doc"}, vals)] == ["Head. "]
    # two varying arguments in the text, or a value that is not a string: no extension
    both = argument_values(verbatim.func, [((), {"doc": "same A", "tag": "t1"}), ((), {"doc": "same B", "tag": "t2"})],
                           {"doc", "tag"})
    assert [x.text for x in batch_prefix(verbatim.trace(doc="same A", tag="t1"), {"doc", "tag"}, both)] == ["Head. "]
    assert [x.text for x in batch_prefix(g, {"doc"}, {"doc": ["same start A", 3]})] == ["Head. "]


class _CompileCountingEngine(FakeEngine):
    """A FakeEngine with `precompile`: records which constraints were compiled ahead of time."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.precompiled = []

    def precompile(self, params):
        from concurrent.futures import Future

        self.precompiled.append(params.json_schema or params.regex)
        fut = Future()
        fut.set_result(None)
        return fut


def test_every_distinct_constraint_is_precompiled_once():
    @di.function
    def typed(s, schema, i):
        s += f"Record {i}: " + di.gen("obj", json_schema=schema, max_tokens=64)
        s += "\nCode: " + di.gen("code", regex=r"[A-Z]{3}")

    schemas = [{"type": "object", "properties": {f"f{k}": {"type": "integer"}}, "required": [f"f{k}"]}
               for k in range(5)]
    eng = _CompileCountingEngine()
    batch = [{"schema": schemas[i % 5], "i": i} for i in range(10)]
    states = typed.run_batch(batch, backend=eng, temperature=0.0)
    assert all(st.ok for st in states), [st.error() for st in states]
    assert len(eng.precompiled) == 6 and eng.precompiled.count(r"[A-Z]{3}") == 1
    eng2 = _CompileCountingEngine()
    typed.run_batch(batch, backend=eng2, temperature=0.0, compile=False)
    assert eng2.precompiled == []
    eng3 = _CompileCountingEngine()  # run() and arun() compile their constraints ahead too
    assert typed.run(schemas[0], 0, backend=eng3, temperature=0.0).ok
    assert len(eng3.precompiled) == 2
    assert typed.run(schemas[0], 0, backend=eng3, temperature=0.0, compile=False).ok
    assert len(eng3.precompiled) == 2


def test_runtime_parks_requests_whose_constraint_still_compiles():
    from concurrent.futures import Future

    class SlowCompile(FakeEngine):
        def __init__(self):
            super().__init__()
            self.futures = []

        def precompile(self, params):
            fut = Future()
            self.futures.append(fut)
            return fut

    @di.function
    def two(s, i):
        s += f"Q{i}: " + di.gen("plain", max_tokens=3)
        s += " then " + di.gen("num", regex=r"\d+")

    eng = SlowCompile()
    import threading

    def finish_later():
        import time

        time.sleep(0.3)
        # no constrained request may reach the engine before its compile is done
        assert not any(p.regex for _, _, p in eng.log)
        for f in eng.futures:
            f.set_result(None)

    t = threading.Thread(target=finish_later)
    t.start()
    states = two.run_batch([{"i": 0}, {"i": 1}], backend=eng, temperature=0.0)
    t.join()
    assert all(st.ok for st in states) and all(st["num"].isdigit() for st in states)
    assert len(eng.futures) == 1


def test_compile_false_and_positional_tuples_and_bind(engine):
    @di.function
    def greet(s, name, punct="!"):
        s += "Hello " + name + punct + di.gen("x", max_tokens=3)

    a = greet.run_batch([("Alice",), ("Bob", "?")], backend=engine, temperature=0.0)
    b = greet.run_batch([{"name": "Alice"}, {"name": "Bob", "punct": "?"}], backend=engine, temperature=0.0,
                        compile=False)
    assert [st.text() for st in a] == [st.text() for st in b]
    shout = greet.bind(punct="!!!")
    assert shout.run("Carol", backend=engine, temperature=0.0).text().startswith("Hello Carol!!!")
    with pytest.raises(InvalidRequestError, match="no argument"):
        greet.bind(nope=1)
    with pytest.raises(InvalidRequestError, match="tuple"):
        greet.run_batch([5], backend=engine)


def test_planned_prefix_is_pinned_while_the_batch_runs():
    events = []

    class PinningEngine(FakeEngine):
        def pin_prefix(self, ids):
            events.append(("pin", len(ids), self.has_unfinished()))
            return "handle"

        def unpin_prefix(self, handle):
            events.append(("unpin", handle, self.has_unfinished()))

    eng = PinningEngine()
    docs = [f"Person {i} lives in Paris." for i in range(5)]
    states = three_stage.run_batch([{"doc": d} for d in docs], backend=eng, temperature=0.0)
    assert all(st.ok for st in states)
    prefix_len = len(next(ids for _, ids, p in eng.log if p.max_tokens == 0))
    assert events[0][:2] == ("pin", prefix_len) and events[-1][:2] == ("unpin", "handle") and len(events) == 2
    # interpreted: the collected prefix is shared but not pinned
    events.clear()
    three_stage.run_batch([{"doc": d} for d in docs], backend=PinningEngine(), temperature=0.0, compile=False)
    assert events == []


def test_bad_first_job_fails_alone_in_a_compiled_batch():
    """An unknown argument in the batch's first job is that program's error (planning used to raise)."""
    jobs = [{"doc": "x", "colour": "red"}] + [{"doc": f"Person {i} lives in Paris."} for i in range(3)]
    states = three_stage.run_batch(jobs, backend=FakeEngine(), temperature=0.0)
    assert not states[0].ok and isinstance(states[0].error(), TypeError)
    assert all(st.ok for st in states[1:]), [st.error() for st in states[1:]]


class _TimedCompileEngine(FakeEngine):
    """precompile futures finish `delay` seconds after the call; records, per call, whether the
    first compile had finished by then."""

    def __init__(self, delay=0.03):
        super().__init__()
        self.delay, self.calls, self.futs = delay, [], []

    def precompile(self, params):
        import threading
        from concurrent.futures import Future

        fut = Future()
        self.calls.append((params.json_schema, bool(self.futs) and self.futs[0].done()))
        self.futs.append(fut)
        t = threading.Timer(self.delay, fut.set_result, (None,))
        t.daemon = True
        t.start()
        return fut


def test_the_first_programs_constraint_compiles_before_the_later_ones_start():
    @di.function
    def typed(s, schema, i):
        s += f"Record {i}: " + di.gen("obj", json_schema=schema, max_tokens=32)

    schemas = [{"type": "object", "properties": {f"k{k}": {"type": "integer"}}, "required": [f"k{k}"]}
               for k in range(4)]
    eng = _TimedCompileEngine()
    states = typed.run_batch([{"schema": sc, "i": i} for i, sc in enumerate(schemas)], backend=eng, temperature=0.0)
    assert all(st.ok for st in states), [st.error() for st in states]
    assert [c[0] for c in eng.calls] == schemas
    assert all(first_done for _, first_done in eng.calls[1:]), eng.calls
    # interpreted runs give the same states
    again = typed.run_batch([{"schema": sc, "i": i} for i, sc in enumerate(schemas)], backend=FakeEngine(),
                            temperature=0.0, compile=False)
    assert [st.text() for st in again] == [st.text() for st in states]


def test_a_slow_first_compile_holds_the_later_ones_back_only_wait_s():
    from concurrent.futures import Future

    from deepinfer.engine.sampling_params import SamplingParams
    from deepinfer.lang.backend import EngineBackend

    eng = _TimedCompileEngine(delay=0.0)
    be = EngineBackend(eng)
    never = Future()  # the first program's compile, still running
    later = [SamplingParams(json_schema={"type": "object", "properties": {f"x{k}": {"type": "string"}}})
             for k in range(2)]
    assert be.precompile_after([never], later, wait_s=0.05) == 2
    assert be.compiling(later[0]) and eng.calls == []  # held, and counted as compiling meanwhile
    import time

    deadline = time.time() + 5
    while be.compiling(later[0]) or be.compiling(later[1]):
        assert time.time() < deadline
        time.sleep(0.01)
    assert [c[0] for c in eng.calls] == [p.json_schema for p in later] and not never.done()


class _SteppedCompileEngine(_TimedCompileEngine):
    """Also records, per precompile call, how many engine steps had returned by then."""

    def __init__(self, delay=0.0):
        super().__init__(delay)
        self.steps, self.at = 0, []

    def precompile(self, params):
        self.at.append(self.steps)
        return super().precompile(params)

    def step(self):
        outs = super().step()
        self.steps += 1
        return outs


def test_the_later_compiles_wait_for_the_first_programs_step():
    """The first program's request steps with no compile beside it: the later programs' constraints
    start compiling only once the engine's first step has returned."""
    @di.function
    def typed(s, schema, i):
        s += f"Record {i}: " + di.gen("obj", json_schema=schema, max_tokens=32)

    schemas = [{"type": "object", "properties": {f"s{k}": {"type": "integer"}}, "required": [f"s{k}"]}
               for k in range(5)]
    eng = _SteppedCompileEngine(delay=0.01)
    states = typed.run_batch([{"schema": sc, "i": i} for i, sc in enumerate(schemas)], backend=eng, temperature=0.0)
    assert all(st.ok for st in states), [st.error() for st in states]
    assert [c[0] for c in eng.calls] == schemas
    assert eng.at[0] == 0 and all(n >= 1 for n in eng.at[1:]), eng.at


def test_the_later_programs_are_traced_and_run_after_the_first_step():
    """With distinct constraints per program, the compiler's plain trace of each later program (to
    list its constraint) and the later programs themselves run after the engine's first step: only
    the first program's work stands between the run_batch call and the first request."""
    from deepinfer.lang.trace import TraceState

    eng = _SteppedCompileEngine(delay=0.01)
    traced_at: list[tuple[int, int]] = []
    started_at: list[tuple[int, int]] = []

    @di.function
    def typed(s, schema, i):
        (traced_at if isinstance(s, TraceState) else started_at).append((i, eng.steps))
        s += f"Record {i}: " + di.gen("obj", json_schema=schema, max_tokens=32)

    schemas = [{"type": "object", "properties": {f"t{k}": {"type": "integer"}}, "required": [f"t{k}"]}
               for k in range(5)]
    states = typed.run_batch([{"schema": sc, "i": i} for i, sc in enumerate(schemas)], backend=eng, temperature=0.0)
    assert all(st.ok for st in states), [st.error() for st in states]
    # (the first program's trace, its argument variants (i = 1 among them) and the last program's
    # first prompt, for the shared prefix, come before: the graph needs them)
    later = [n for i, n in traced_at if 2 <= i <= 3]
    assert len(later) == 2 and all(n >= 1 for n in later), traced_at
    assert sorted(started_at)[0] == (0, 0) and all(n >= 1 for i, n in started_at if i >= 1), started_at
    # interpreted, every program starts at once
    started_at.clear()
    eng.steps = 0
    typed.run_batch([{"schema": sc, "i": i} for i, sc in enumerate(schemas)], backend=eng, temperature=0.0,
                    compile=False)
    assert all(n == 0 for _, n in started_at), started_at
    assert [c[0] for c in eng.calls] == schemas and eng.at[0] == 0 and all(n >= 1 for n in eng.at[1:])
    again = typed.run_batch([{"schema": sc, "i": i} for i, sc in enumerate(schemas)], backend=FakeEngine(),
                            temperature=0.0, compile=False)
    assert [st.text() for st in again] == [st.text() for st in states]


def test_held_compiles_start_when_the_first_program_never_steps():
    """The first program fails before its request reaches the engine: nothing steps, so the held
    compiles start anyway and the other programs finish (no hang)."""
    @di.function
    def typed(s, schema, i):
        if i == 0:
            raise ValueError("first program fails")
        s += f"Record {i}: " + di.gen("obj", json_schema=schema, max_tokens=32)

    schemas = [{"type": "object", "properties": {f"h{k}": {"type": "string"}}, "required": [f"h{k}"]}
               for k in range(4)]
    eng = _SteppedCompileEngine(delay=0.01)
    states = typed.run_batch([{"schema": sc, "i": i} for i, sc in enumerate(schemas)], backend=eng, temperature=0.0)
    assert not states[0].ok and isinstance(states[0].error(), ValueError)
    assert all(st.ok for st in states[1:]), [st.error() for st in states[1:]]
    assert eng.steps >= 1
