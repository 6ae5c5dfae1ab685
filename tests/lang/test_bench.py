"""The frontend-overhead micro-benchmark runs and reports consistent figures."""

from deepinfer.lang.bench import frontend_overhead_us, prefix_sharing_comparison
from deepinfer.lang.testing import FakeEngine


def test_frontend_overhead_benchmark():
    r = frontend_overhead_us(n_programs=40, gens_per_program=3, max_in_flight=16)
    assert r["gens"] == 120
    assert 0 < r["engine_s"] < r["wall_s"]
    assert 0 < r["us_per_gen_frontend"] < r["us_per_gen_total"]


def test_prefix_sharing_comparison_on_fake_engine():
    system = "You are a helpful assistant who answers every question about cities briefly."
    r = prefix_sharing_comparison(FakeEngine(), [f"Question {i}?" for i in range(12)], system, max_tokens=4)
    # the fake engine's cache persists between the two runs, so compare the first (shared) run only
    assert r["share_prefix"]["cached_tokens"] >= 12 * 16
    assert r["share_prefix"]["prompt_tokens"] == r["no_share"]["prompt_tokens"]
