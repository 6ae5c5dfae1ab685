"""The CUDA-only engine pieces: config validation and bucket arithmetic run everywhere; CUDA graphs
and the stream-overlapped loop are checked against the eager / synchronous engine on a GPU."""

from __future__ import annotations

import re

import pytest
import torch

from deepinfer import Engine, SamplingParams
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.cuda_graphs import bucket_for, bucket_sizes
from deepinfer.errors import InvalidRequestError


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(cuda_graphs=1), "cuda_graphs must be True or False"),
        (dict(cuda_graphs=True, device="cpu"), "needs a CUDA device"),
        (dict(cuda_graphs=True, device="cuda", batch_invariant=True), "cannot be combined"),
    ],
)
def test_cuda_graphs_option_is_validated(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        EngineConfig(**kw)


def test_buckets_cover_every_batch_size_once():
    assert bucket_sizes(256) == [1, 2, 4, 8, 16] + list(range(32, 257, 32))
    assert bucket_sizes(5) == [1, 2, 4, 5]
    assert bucket_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    b = bucket_sizes(100)
    for n in range(1, 101):
        got = bucket_for(n, b)
        assert got >= n and all(x < n for x in b if x < got)  # the smallest bucket holding n
    assert bucket_for(101, b) is None


def test_cpu_engine_keeps_the_thread_overlap_and_no_graphs(tiny_models):
    eng = Engine(str(tiny_models["llama"]), device="cpu", kv_cache_memory=16 << 20, overlap_schedule=True)
    assert eng.runner.graphs is None and eng._stream_forward is None and eng._executor is not None


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return "cuda"


PROMPTS = ["hello world", "the quick brown fox jumps", "a b c d e f g", "def add(a, b):"] * 5


@pytest.mark.gpu
def test_graph_replay_gives_the_eager_outputs(tiny_models):
    dev = _cuda()
    sp = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)] * 10
    common = dict(device=dev, kv_cache_memory=64 << 20, max_num_seqs=32, max_model_len=256)
    eager = Engine(str(tiny_models["qwen3"]), **common).generate(PROMPTS, sp)
    eng = Engine(str(tiny_models["qwen3"]), cuda_graphs=True, **common)
    if eng.runner.graphs is None:
        pytest.skip("the paged decode kernel is not available (TileLang missing)")
    graphed = eng.generate(PROMPTS, sp)
    assert eng.runner.graphs.replays > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]


@pytest.mark.gpu
def test_stream_overlap_gives_the_synchronous_outputs(tiny_models):
    dev = _cuda()
    sp = [SamplingParams(temperature=0.7, seed=i, max_tokens=10, ignore_eos=True) for i in range(len(PROMPTS))]
    common = dict(device=dev, kv_cache_memory=64 << 20)
    sync = Engine(str(tiny_models["llama"]), **common).generate(PROMPTS, sp)
    eng = Engine(str(tiny_models["llama"]), overlap_schedule=True, **common)
    assert eng._stream_forward is not None and eng._executor is None
    over = eng.generate(PROMPTS, sp)
    assert [o.token_ids for o in over] == [o.token_ids for o in sync]
    assert eng.stats.forward_time > 0 and 0 <= eng.stats.idle_share < 1


@pytest.mark.gpu
def test_grammar_and_penalties_on_cuda(tiny_models):
    dev = _cuda()
    eng = Engine(str(tiny_models["llama"]), device=dev, kv_cache_memory=64 << 20)
    outs = eng.generate(PROMPTS[:8], [SamplingParams(temperature=0.8, seed=i, max_tokens=24, regex=r"(yes|no), [a-z]{2,6}!")
                                      for i in range(8)])
    assert all(re.fullmatch(r"(yes|no), [a-z]{2,6}!", o.text) for o in outs if o.finish_reason == "stop")
    assert all(o.finish_reason != "error" for o in outs)
    pen = SamplingParams(temperature=0.9, seed=1, max_tokens=16, repetition_penalty=1.5, frequency_penalty=0.5,
                         presence_penalty=0.5)
    outs = eng.generate(PROMPTS[:4], pen)
    assert all(o.finish_reason != "error" for o in outs)


def test_sdpa_scope_leaves_out_cudnn_on_cuda_only():
    """attention.sdpa_scope: the backend flags a CUDA forward runs under (cuDNN's per-shape plans,
    attention.py), restored after it; a CPU forward's scope touches nothing."""
    from deepinfer.engine.attention import sdpa_scope

    b = torch.backends.cuda
    before = (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())
    with sdpa_scope(torch.device("cuda")):
        assert not b.cudnn_sdp_enabled()
        assert b.flash_sdp_enabled() and b.mem_efficient_sdp_enabled() and b.math_sdp_enabled()
    assert (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()) == before
    with sdpa_scope(torch.device("cpu")):
        assert (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()) == before


@pytest.mark.gpu
def test_cuda_forward_runs_sdpa_without_cudnn(tiny_models, monkeypatch):
    """Every SDPA call of a CUDA engine's step (prefills here, and decodes with kernels="torch") runs with
    cuDNN's backend off."""
    import deepinfer.engine.attention as A

    dev = _cuda()
    seen = []
    sdpa = A.F.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*a, **kw)

    monkeypatch.setattr(A.F, "scaled_dot_product_attention", spy)
    eng = Engine(str(tiny_models["qwen3"]), device=dev, dtype="bfloat16", kv_cache_memory=64 << 20, kernels="torch")
    eng.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert seen and not any(seen)
