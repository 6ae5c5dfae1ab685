"""Every kernel of a CPU engine runs on the process's one compute thread (engine/compute_thread.py),
whichever thread loads, steps or forks it; calls keep the caller's context and exceptions."""

from __future__ import annotations

import contextvars
import threading

import pytest

from deepinfer import Engine, SamplingParams
from deepinfer.engine.compute_thread import compute_thread
from deepinfer.errors import InvalidRequestError


def _threads_of(engine: Engine, method: str) -> list[str]:
    seen = []
    fn = getattr(engine.runner, method)

    def spy(*a, **k):
        seen.append(threading.current_thread().name)
        return fn(*a, **k)

    setattr(engine.runner, method, spy)
    return seen


def test_loading_stepping_and_forking_run_on_the_compute_thread(tiny_models):
    engine = Engine(str(tiny_models["llama"]), kv_cache_memory=8 << 20, block_size=16)
    forward = _threads_of(engine, "forward")
    copies = _threads_of(engine, "copy_kv_tokens")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = engine.generate(["the cat sat on the mat"], sp)[0].token_ids
    # from another thread (as deepinfer.lang's runtime steps it): the same thread computes, the same tokens
    got = []
    t = threading.Thread(target=lambda: got.append(engine.generate(["the cat sat on the mat"], sp)[0].token_ids),
                         name="caller")
    t.start()
    t.join()
    assert got == [ref]
    rid = engine.add_request("the cat sat on", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while not any(o.token_ids for o in engine.step()):
        pass
    kids = engine.fork(rid, 2)
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(kids) <= set(outs)
    assert forward and set(forward) == {"deepinfer-compute"}
    assert set(copies) == {"deepinfer-compute"}  # the fork's copy of the parent's partly filled page


def test_construction_runs_on_the_compute_thread(tiny_models, monkeypatch):
    from deepinfer.engine import model_runner

    built_on = []
    init = model_runner.ModelRunner.__init__

    def spy(self, *a, **k):
        built_on.append(threading.current_thread().name)
        init(self, *a, **k)

    monkeypatch.setattr(model_runner.ModelRunner, "__init__", spy)
    Engine(str(tiny_models["llama"]), kv_cache_memory=8 << 20)
    assert built_on == ["deepinfer-compute"]


def test_calls_keep_the_callers_context_and_errors():
    th = compute_thread()
    var = contextvars.ContextVar("v", default="unset")
    token = var.set("caller's")
    try:
        assert th.run(lambda: (var.get(), threading.current_thread().name)) == ("caller's", "deepinfer-compute")
    finally:
        var.reset(token)
    with pytest.raises(InvalidRequestError, match="named problem"):
        th.run(lambda: (_ for _ in ()).throw(InvalidRequestError("named problem")))
    # a call made from the thread itself (a callback into an engine) runs in place instead of waiting on itself
    assert th.run(lambda: th.run(lambda: threading.current_thread().name)) == "deepinfer-compute"
    assert compute_thread() is th  # one per process
