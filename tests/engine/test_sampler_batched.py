"""The batched sampler (prepare once, tensor ops per step) against a row-at-a-time reference,
bit for bit; its device-generic ops; the fused route's rule and its kernel on CPU."""

from __future__ import annotations

import random
import re

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.engine.sampler import Sampler, SamplingRow, prepare
from deepinfer.errors import InvalidRequestError
from deepinfer_kernels import rng
from deepinfer_kernels.inverse_cdf import inverse_cdf_sample, row_uniform, row_uniforms

V = 300


def reference_row(x: torch.Tensor, r: SamplingRow) -> int:
    """One row, straight from the definitions (HF repetition penalty; OpenAI frequency/presence)."""
    x = x.clone()
    p = r.params
    if p.repetition_penalty != 1.0:
        for t in sorted(set(r.prompt_ids) | set(r.output_ids)):
            if t < x.numel():
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    if (p.frequency_penalty or p.presence_penalty) and r.output_ids:
        counts = torch.bincount(torch.tensor(r.output_ids), minlength=x.numel())[: x.numel()].float()
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    for t in r.banned:
        x[t] = float("-inf")
    if p.greedy:
        return int(x.argmax())
    x = (x / torch.tensor(p.temperature, dtype=torch.float32))[None]
    if 0 < p.top_k < x.shape[1]:
        kth = x.sort(descending=True).values[0, p.top_k - 1]
        x[x < kth] = float("-inf")
    if p.top_p < 1.0:
        s, idx = x.sort(descending=True)
        pr = s.softmax(-1)
        drop = torch.zeros_like(x, dtype=torch.bool).scatter_(1, idx, (pr.cumsum(-1) - pr) >= torch.tensor(p.top_p))
        x[drop] = float("-inf")
    if p.min_p > 0:
        pr = x.softmax(-1)
        x[pr < pr.max() * torch.tensor(p.min_p)] = float("-inf")
    u = torch.tensor([row_uniform(rng.row_key(r.seed, r.position))], dtype=torch.float64)
    return int(inverse_cdf_sample(x, u)[0])


def random_rows(n: int, seed: int) -> list[SamplingRow]:
    rnd = random.Random(seed)
    kinds = [
        lambda: SamplingParams(temperature=0),
        lambda: SamplingParams(temperature=rnd.uniform(0.3, 1.5)),
        lambda: SamplingParams(temperature=0.9, top_k=rnd.choice([1, 5, 50, V + 10])),
        lambda: SamplingParams(temperature=0.9, top_p=rnd.uniform(0.2, 0.99)),
        lambda: SamplingParams(temperature=0.9, min_p=rnd.uniform(0.01, 0.3)),
        lambda: SamplingParams(temperature=0.7, repetition_penalty=rnd.uniform(1.05, 2.0)),
        lambda: SamplingParams(temperature=0, frequency_penalty=rnd.uniform(-1, 1), presence_penalty=rnd.uniform(-1, 1)),
        lambda: SamplingParams(temperature=0.8, top_p=0.9, top_k=20, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    rows = []
    for i in range(n):
        p = rnd.choice(kinds)()
        out = [rnd.randrange(V + 5) for _ in range(rnd.randrange(0, 30))]  # ids >= V are ignored
        prompt = [rnd.randrange(V) for _ in range(rnd.randrange(1, 40))]
        banned = rnd.sample(range(V), rnd.randrange(0, 3))
        rows.append(SamplingRow(p, rnd.randrange(2**64), rnd.randrange(10_000), prompt, out, banned))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_batched_sampler_equals_the_row_reference_bitwise(seed):
    rows = random_rows(37, seed)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 4
    want = [reference_row(logits[i], r) for i, r in enumerate(rows)]
    got = Sampler(fused="never").sample(logits.clone(), prepare(rows, V, "cpu")).tolist()
    assert got == want


def test_uniforms_from_python_and_tensor_agree_bitwise():
    keys = [0, 1, 2**32 - 1, 0x5BD1E995] + [rng.row_key(s, p) for s in (0, 7, 2**63 + 5) for p in (0, 1, 99999)]
    assert row_uniforms(keys, "cpu").tolist() == [row_uniform(k) for k in keys]


def test_prepare_builds_tensors_only_for_what_the_batch_uses():
    rows = [SamplingRow(SamplingParams(temperature=0), 1, 5, [1], [2], []) for _ in range(3)]
    b = prepare(rows, V, "cpu")
    assert b.all_greedy and b.penalties is None and b.temps is None and b.ban_r is None
    rows.append(SamplingRow(SamplingParams(temperature=0.5, top_p=0.5), 1, 5, [1], [2], [0, V + 3]))
    b = prepare(rows, V, "cpu")
    assert not b.all_greedy and b.greedy_idx.tolist() == [0, 1, 2] and b.sampled_idx.tolist() == [3]
    assert b.top_k is None and b.min_p is None and b.top_p.tolist() == [0.5]
    assert b.ban_r.tolist() == [3] and b.ban_c.tolist() == [0]  # the out-of-vocab ban is dropped
    assert not b.fusable


def test_every_op_runs_on_the_logits_device():
    # "meta" tensors carry no data: a host tensor mixed into device math (the old CPU bincount
    # subtracted from a device row) raises here, as it would on CUDA
    rows = random_rows(16, 3)
    logits = torch.empty(16, V, device="meta")
    b = prepare(rows, V, "meta")
    assert b.penalties is not None and b.penalties.rows.device.type == "meta"
    out = Sampler(fused="never").sample(logits, b)
    assert out.device.type == "meta" and out.shape == (16,)


def test_bad_configuration_and_mismatched_batch_raise_typed_errors():
    with pytest.raises(InvalidRequestError, match="fused"):
        Sampler(fused="sometimes")
    rows = random_rows(3, 0)
    with pytest.raises(InvalidRequestError, match="3 rows, logits have 2"):
        Sampler().sample(torch.zeros(2, V), prepare(rows, V, "cpu"))


def test_fused_route_rule():
    plain = [SamplingRow(SamplingParams(temperature=0.8), 1, i, [1], [], [2]) for i in range(4)]
    filt = plain + [SamplingRow(SamplingParams(temperature=0.8, top_p=0.9), 1, 9, [1], [], [])]
    pen = plain + [SamplingRow(SamplingParams(temperature=0.8, presence_penalty=0.5), 1, 9, [1], [3], [])]
    greedy = [SamplingRow(SamplingParams(temperature=0), 1, 9, [1], [], [])]
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto, always = Sampler(), Sampler(fused="always")
    assert not auto.fused_route(prepare(plain, V, cpu), cpu)  # CPU batches stay on torch ops
    assert always.fused_route(prepare(plain, V, cpu), cpu)
    for rows in (filt, pen, greedy):  # penalties / filters need the torch ops; all-greedy is one argmax
        assert not always.fused_route(prepare(rows, V, cpu), cpu)
    assert not Sampler(fused="never").fused_route(prepare(plain, V, cpu), cuda)
    assert not Sampler(kernels="torch").fused_route(prepare(plain, V, cpu), cuda)  # Engine(kernels="torch")
    assert Sampler(kernels="tilelang").fused_route(prepare(plain, V, cpu), cuda)


def test_fused_kernel_route_draws_what_the_torch_route_draws(tilelang_available):
    rnd = random.Random(1)
    rows = [SamplingRow(SamplingParams(temperature=0 if i % 5 == 0 else rnd.uniform(0.5, 1.5)),
                        rnd.randrange(2**32), rnd.randrange(1000), [1], [], [3, 4] if i % 3 == 0 else [])
            for i in range(64)]
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(2)) * 3
    torch_route = Sampler(fused="never").sample(logits.clone(), prepare(rows, 5000, "cpu"))
    kernel_route = Sampler(fused="always").sample(logits.clone(), prepare(rows, 5000, "cpu"))
    # the same draw at the same uniform; only float rounding of the sums differs (see kernels/sampling.py)
    assert (torch_route != kernel_route).sum() <= 1
    assert not set(kernel_route[::3].tolist()) & {3, 4}  # bans hold on the kernel route


@pytest.fixture
def tilelang_available():
    from deepinfer_kernels import _tilelang

    if not _tilelang.available():
        pytest.skip("tilelang is not importable")
    return True


def test_engine_on_the_fused_route_writes_what_the_torch_route_writes(tiny_models, tilelang_available, monkeypatch):
    # the CUDA route's code (grammar mask handed to the kernel, not applied by torch) run on the CPU
    # through the kernel's C twin: same tokens as the torch route, grammar respected
    from deepinfer import Engine

    prompts = ["hello world", "the quick brown fox", "a b c", "def add(a, b):"] * 2
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, regex=r"(yes|no), [a-z]{2,6}!") if i % 2 else
              SamplingParams(temperature=0.9, seed=i, max_tokens=24, min_tokens=24) for i in range(len(prompts))]
    # the free rows outlive every regex row (<= 16 tokens), so the last steps carry no grammar row whatever
    # the timing of the grammar compile (a cached compile used to leave no grammar-free step at all)
    from deepinfer_kernels import dispatch

    calls = []
    real = dispatch.masked_sample
    monkeypatch.setattr(dispatch, "masked_sample", lambda lg, bm, t, k: calls.append(bm is not None) or real(lg, bm, t, k))
    outs = {}
    for fused in ("never", "always"):
        eng = Engine(str(tiny_models["llama"]), device="cpu", kv_cache_memory=16 << 20)
        eng.step_sampler.sampler = Sampler(fused=fused)
        outs[fused] = eng.generate(prompts, params)
    assert any(calls) and not all(calls)  # kernel steps with a grammar mask handed over, and without
    assert [o.token_ids for o in outs["always"]] == [o.token_ids for o in outs["never"]]
    for o, p in zip(outs["always"], params):
        assert o.finish_reason != "error"
        if p.regex and o.finish_reason == "stop":
            assert re.fullmatch(p.regex, o.text)
