"""The frontend-overhead micro-benchmark runs and reports consistent figures."""

from deepinfer.lang.bench import frontend_overhead_us, prefix_sharing_comparison
from deepinfer.lang.testing import FakeEngine


def test_frontend_overhead_benchmark():
    r = frontend_overhead_us(n_programs=40, gens_per_program=3, max_in_flight=16)
    assert r["gens"] == 120
    assert 0 < r["engine_s"] < r["wall_s"]
    assert 0 < r["us_per_gen_frontend"] < r["us_per_gen_total"]
    # the frontend's own tokenizer calls are part of its time; the CPU figure replays the engine alone
    assert 0 < r["us_per_gen_tokenizer"] < r["us_per_gen_frontend"]
    assert r["cpu_us_per_gen_frontend"] < r["us_per_gen_total"] * 4


def test_replay_reproduces_the_engine_calls():
    from deepinfer.lang.bench import _bench_program, _TimedEngine, replay_cpu

    timed = _TimedEngine(FakeEngine(tokens_per_step=8))
    states = _bench_program.run_batch([{"i": i, "turns": 2} for i in range(5)], backend=timed)
    assert all(st.ok for st in states)
    adds = sum(c[0] == "add" for c in timed.calls)
    assert adds == 11 and any(c[0] == "step" for c in timed.calls)  # 10 gens + the shared system prompt
    fresh = FakeEngine(tokens_per_step=8)
    assert replay_cpu(timed.calls, fresh) >= 0
    # the replay saw the same requests and ran every one of them to the end
    assert [e[1] for e in fresh.log] == [e[1] for e in timed._e.log] and not fresh.has_unfinished()


def test_prefix_sharing_comparison_on_fake_engine():
    system = "You are a helpful assistant who answers every question about cities briefly."
    r = prefix_sharing_comparison(FakeEngine(), [f"Question {i}?" for i in range(12)], system, max_tokens=4)
    # the fake engine's cache persists between the two runs, so compare the first (shared) run only
    assert r["share_prefix"]["cached_tokens"] >= 12 * 16
    assert r["share_prefix"]["prompt_tokens"] == r["no_share"]["prompt_tokens"]


def test_encode_cost_compares_on_equal_ids():
    from deepinfer.lang.bench import encode_cost_us
    from deepinfer.lang.testing import FakeTokenizer

    e = encode_cost_us(FakeTokenizer(), n_programs=5, turns=2, rounds=1)
    assert e["whole"] > 0 and e["pieces"] > 0 and e["markers"] == 2
