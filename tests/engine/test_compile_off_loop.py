"""Grammars compile off the step loop: a request whose schema is still compiling waits in a
"compiling" state while the others decode, and a compile past the time limit fails only its own
request."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from deepinfer import Engine, SamplingParams
from deepinfer.grammar.compiler import AUTO_ORDER
from deepinfer.grammar.llguidance_backend import LLGuidanceBackend
from deepinfer.grammar.xgrammar_backend import XGrammarBackend

# the backend the default chain compiles a schema on first: a slow compile is staged there
FIRST = {"llguidance": LLGuidanceBackend, "xgrammar": XGrammarBackend}[AUTO_ORDER["json_schema"][0]]

SLOW_S = 0.3  # each "slow" schema takes this long to compile (well over a tiny-model step)


def _schema(i: int) -> dict:
    return {"title": f"slow-{i}", "type": "object", "properties": {f"k{i}": {"type": "integer"}},
            "required": [f"k{i}"], "additionalProperties": False}


@pytest.fixture
def slow_compiles(monkeypatch):
    """Compiles of specs titled slow-* (on the default chain's first schema backend) sleep first,
    standing in for a heavy schema."""
    original = FIRST.compile
    calls = []

    def compile(self, spec):
        if '"slow-' in spec.text:
            calls.append(spec.text)
            time.sleep(SLOW_S)
        return original(self, spec)

    monkeypatch.setattr(FIRST, "compile", compile)
    return calls


def _engine(tiny_models, **kw):
    return Engine(str(tiny_models["llama"]), kv_cache_memory=16 << 20, enable_prefix_caching=False, **kw)


def test_fifty_slow_schemas_compile_while_sixteen_requests_decode(tiny_models, slow_compiles):
    eng = _engine(tiny_models)
    free = [eng.add_request([5 + i, 7, 9], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            for i in range(16)]
    eng.step()
    schemas = {}
    for i in range(50):
        rid = eng.add_request("x", SamplingParams(json_schema=_schema(i), temperature=1.0, seed=i, max_tokens=16,
                                                  complete_within_budget=True))
        schemas[rid] = _schema(i)
    # none of them waited for its compile: all 50 are held back, none is scheduled yet
    assert eng.num_compiling >= 48, eng.num_compiling
    done: dict[str, object] = {}
    free_done_while_compiling = None
    steps_with_decode_while_compiling = 0
    while eng.has_unfinished():
        compiling_before = eng.num_compiling
        outs = eng.step()
        if compiling_before and any(o.request_id in free and o.delta_token_ids for o in outs):
            steps_with_decode_while_compiling += 1
        for o in outs:
            if o.finished:
                done[o.request_id] = o
        if free_done_while_compiling is None and all(r in done for r in free):
            free_done_while_compiling = eng.num_compiling
    # the 16 decoded to the end while grammars were still compiling (50 x 0.3 s on 2 threads)
    assert free_done_while_compiling and free_done_while_compiling > 0
    assert steps_with_decode_while_compiling >= 20
    assert all(len(done[r].token_ids) == 24 for r in free)
    for rid, schema in schemas.items():
        o = done[rid]
        assert o.finish_reason == "stop", (o.finish_reason, o.error, o.text)
        jsonschema.validate(json.loads(o.text), schema)
    assert len(slow_compiles) == 50
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_blocks


def test_a_compile_past_the_limit_fails_only_its_request(tiny_models, monkeypatch):
    original = FIRST.compile

    def compile(self, spec):
        if '"slow-' in spec.text:
            time.sleep(1.5)
        return original(self, spec)

    monkeypatch.setattr(FIRST, "compile", compile)
    eng = _engine(tiny_models, grammar_fallback=False, grammar_compile_timeout=0.2)
    ok = eng.add_request([5, 7, 9], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    bad = eng.add_request("x", SamplingParams(json_schema=_schema(0), max_tokens=8))
    fine = eng.add_request("y", SamplingParams(json_schema={"type": "integer"}, temperature=0, max_tokens=8))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs[bad].finish_reason == "error" and "compile_timeout" in outs[bad].error
    assert outs[ok].finish_reason == "length" and len(outs[ok].token_ids) == 20
    assert outs[fine].finish_reason in ("stop", "length") and outs[fine].error is None


def test_abort_while_compiling(tiny_models, slow_compiles):
    eng = _engine(tiny_models)
    eng.add_request([5, 7, 9], SamplingParams(temperature=0, max_tokens=4))
    rid = eng.add_request("x", SamplingParams(json_schema=_schema(99), max_tokens=8))
    assert eng.num_compiling == 1
    assert eng.abort(rid)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    aborted = [o for o in outs if o.request_id == rid]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort"
    assert eng.num_compiling == 0


def test_idle_engine_compiles_at_submission(tiny_models):
    eng = _engine(tiny_models)
    eng.add_request("x", SamplingParams(json_schema={"type": "boolean"}, max_tokens=4))
    assert eng.num_compiling == 0  # nothing else to run: compiled now, errors raise at add_request


def _run_all(eng) -> dict:
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 7}])
def test_a_request_admitted_while_its_precompile_runs_matches_one_admitted_after(tiny_models, slow_compiles,
                                                                                 sampling):
    """On an idle engine a request whose constraint's precompile still runs is queued at once (its
    prefill runs beside the compile) and its first sample waits for the grammar: the same tokens as
    the request submitted once the compile is done."""
    params = SamplingParams(json_schema=_schema(0), max_tokens=16, complete_within_budget=True, **sampling)
    prompt = [5, 7, 9, 11, 13]
    early = _engine(tiny_models)
    fut = early.precompile(params)
    rid = early.add_request(prompt, params)
    assert not fut.done() and early.num_compiling == 0  # queued, not held: its compile still runs
    assert [s.request_id for s in early.scheduler.waiting] == [rid]
    first = early.step()  # prefills while compiling; the sample waited for the grammar
    assert fut.done() and [o.request_id for o in first] == [rid] and len(first[0].token_ids) == 1
    assert early.stats.grammar_wait_time > 0
    got = _run_all(early)[rid]

    after = _engine(tiny_models)
    after.precompile(params).result()
    want = _run_all_after(after, prompt, params)
    assert got.finish_reason == want.finish_reason == "stop", (got.finish_reason, got.error)
    assert got.token_ids == want.token_ids and got.text == want.text
    jsonschema.validate(json.loads(got.text), _schema(0))
    assert early.kv.allocator.num_free == early.kv.allocator.num_blocks


def _run_all_after(eng, prompt, params):
    rid = eng.add_request(prompt, params)
    return _run_all(eng)[rid]


def test_a_busy_engine_still_holds_a_request_whose_precompile_runs(tiny_models, slow_compiles):
    """Only an idle engine takes a still-compiling request into its batch (a slow schema must not
    stall other requests' steps): a busy one holds it as before."""
    eng = _engine(tiny_models)
    eng.add_request([5, 7, 9], SamplingParams(temperature=0, max_tokens=4))
    params = SamplingParams(json_schema=_schema(1), max_tokens=8)
    eng.precompile(params)
    eng.add_request("x", params)
    assert eng.num_compiling == 1
    outs = _run_all(eng)
    assert all(o.finish_reason in ("stop", "length") for o in outs.values())


def test_a_failed_compile_of_an_early_admitted_request_fails_only_it(tiny_models, monkeypatch):
    """The compile fails after the request was queued: it finishes with the compile's error and no
    token, and gives its KV back."""
    from deepinfer.errors import GrammarError

    def compile(self, spec):
        time.sleep(0.2)
        raise GrammarError("cannot compile this one")

    monkeypatch.setattr(FIRST, "compile", compile)
    eng = _engine(tiny_models, grammar_fallback=False)
    params = SamplingParams(json_schema=_schema(2), max_tokens=8)
    fut = eng.precompile(params)
    rid = eng.add_request([5, 7, 9], params)  # does not raise: the compile is still running
    assert not fut.done()
    out = _run_all(eng)[rid]
    assert out.finish_reason == "error" and "cannot compile this one" in out.error and out.token_ids == []
    assert eng.kv.allocator.num_free == eng.kv.allocator.num_blocks
    with pytest.raises(GrammarError, match="cannot compile this one"):  # compiled (failed) now: raises
        eng.add_request([5, 7, 9], params)
