"""The compiled batch's first request goes into the engine while its constraint still compiles (the
engine prefills it meanwhile and waits for the grammar only at its first sample): same states as
interpreted, a compile error included."""

from __future__ import annotations

import time

import pytest

import deepinfer.lang as di
from deepinfer import Engine
from deepinfer.grammar.compiler import AUTO_ORDER
from deepinfer.grammar.llguidance_backend import LLGuidanceBackend
from deepinfer.grammar.xgrammar_backend import XGrammarBackend

# the backend the default chain compiles a schema on first: a slow compile is staged there
FIRST = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}[AUTO_ORDER["json_schema"][0]]

SLOW_S = 0.25


def _schema(tag: str, i: int) -> dict:
    return {"title": f"slow-{tag}-{i}", "type": "object", "properties": {f"{tag}_{i}": {"type": "integer"}},
            "required": [f"{tag}_{i}"], "additionalProperties": False}


@di.function
def record(s, i, schema):
    s += f"Record {i}. As JSON:\n" + di.gen("obj", json_schema=schema, max_tokens=12, complete_within_budget=True)


class _Watch:
    """Wraps the engine's add_request: notes, per request, whether it was queued while its grammar
    still compiled, and whether the engine had anything else to run then."""

    def __init__(self, eng: Engine) -> None:
        self.eng, self.pending, self.busy = eng, [], []
        self._add = eng.add_request

        def add_request(prompt, params=None, request_id=None):
            self.busy.append(eng.has_unfinished())
            rid = self._add(prompt, params, request_id=request_id)
            seq = eng._seqs.get(rid)
            self.pending.append(seq is not None and seq.grammar_pending is not None and eng.num_compiling == 0)
            return rid

        eng.add_request = add_request


@pytest.fixture
def slow(monkeypatch):
    original = FIRST.compile
    fail = set()

    def compile(self, spec):
        if '"slow-' in spec.text:
            time.sleep(SLOW_S)
            if any(f in spec.text for f in fail):
                from deepinfer.errors import GrammarError

                raise GrammarError("this schema does not compile")
        return original(self, spec)

    monkeypatch.setattr(FIRST, "compile", compile)
    return fail


def _engine(tiny_models, **kw) -> Engine:
    return Engine(str(tiny_models["llama"]), kv_cache_memory=16 << 20, batch_invariant=True, **kw)


def _snapshot(states):
    return [(st.text(), repr(st.variables()) if st.ok else None,
             None if st.ok else f"{type(st.error()).__name__}: {st.error()}") for st in states]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 3}])
def test_first_request_is_prefilled_while_its_schema_compiles(tiny_models, slow, sampling):
    eng = _engine(tiny_models)
    watch = _Watch(eng)
    batch = [{"i": i, "schema": _schema("a", i)} for i in range(4)]
    compiled = record.run_batch(batch, backend=eng, **sampling)
    assert all(st.ok for st in compiled), [st.error() for st in compiled]
    # the first request went in while its schema compiled; any other only when nothing else ran
    assert watch.pending[0], watch.pending
    assert not any(p and b for p, b in zip(watch.pending, watch.busy)), (watch.pending, watch.busy)
    assert eng.stats.grammar_wait_time > 0
    again = _engine(tiny_models)  # interpreted, fresh compiles: every request after its compile
    interp = record.run_batch([{"i": i, "schema": _schema("a", i)} for i in range(4)], backend=again,
                              compile=False, **sampling)
    assert _snapshot(compiled) == _snapshot(interp)


def test_a_compile_error_after_early_submission_is_the_programs_error_as_interpreted(tiny_models, slow):
    slow.add("b-0")  # the first program's schema fails to compile, after its request went in
    eng = _engine(tiny_models, grammar_fallback=False)  # (no other backend to fall back on)
    watch = _Watch(eng)
    batch = [{"i": i, "schema": _schema("b", i)} for i in range(3)]
    compiled = record.run_batch(batch, backend=eng, temperature=0.0)
    assert watch.pending[0]
    assert not compiled[0].ok and "this schema does not compile" in str(compiled[0].error())
    assert all(st.ok for st in compiled[1:]), [st.error() for st in compiled[1:]]
    interp = record.run_batch(batch, backend=_engine(tiny_models, grammar_fallback=False),
                              temperature=0.0, compile=False)
    assert _snapshot(compiled) == _snapshot(interp)
    assert not eng.has_unfinished()
    eng.reset_prefix_cache()  # (what the radix cache keeps) the failed request gave its blocks back
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_blocks
