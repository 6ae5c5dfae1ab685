"""Block-FP8 checkpoints with their projections kept as stored (EngineConfig.fp8_weights, fp8_linear.py):
the engine runs them like the dequantised checkpoint (the same weight values, so the same tokens and
logprobs to summation order) on every path that runs them on CPU: the per-call dequantisation, the
TileLang kernels' CPU twins (dense and grouped experts), the batch-invariant mode, chunked prefill
with prefix hits, speculative MTP; the bytes held are the codes and scales; bad settings are named."""

from __future__ import annotations

import pytest

from deepinfer import Engine, InvalidRequestError, SamplingParams
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.fp8_linear import Fp8Linear, kept_projection
from deepinfer.engine.models.mla import MlaAttention
from deepinfer.engine.models.moe import MoeBlock
from deepinfer.engine.placeholder import is_placeholder
from fp8_factory import make_fp8_pair
from model_factory import make_tiny_model
from moe_factory import make_moe_model

transformers = pytest.importorskip("transformers")

PROMPTS = ["The quick brown fox", "Hello world", "a b c d e f g h i j k l m n o p"]
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
MODES = {"dequantize-per-call": {}, "cpu-twins": {"kernels": "tilelang"}, "batch-invariant": {"batch_invariant": True}}


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe", "qwen2_moe", "llama"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":  # dense; q|k|v fuse 72 + 24 + 24 rows, cut mid-block (16-row blocks)
        src = make_tiny_model(root / "src", "llama", seed=5, hidden_size=72, num_attention_heads=6, num_key_value_heads=2)
    else:
        src = make_moe_model(root / "src", request.param, seed=21)
    fp8_dir, ref_dir, shapes = make_fp8_pair(src, root, block=(16, 16))
    return request.param, fp8_dir, ref_dir, shapes


def _run(path, **kw):
    eng = Engine(str(path), kv_cache_memory=2 << 20, **kw)
    return eng, eng.generate(PROMPTS, SP)


def _max_logprob_diff(a, b):
    return max(abs(x.logprob - y.logprob) for o, r in zip(a, b) for x, y in zip(o.logprobs, r.logprobs))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_kept_fp8_runs_like_the_dequantised_checkpoint(pair, mode, tilelang_if_needed):
    arch, fp8_dir, ref_dir, shapes = pair
    kw = MODES[mode]
    if mode == "cpu-twins":
        tilelang_if_needed()
    eng, out = _run(fp8_dir, fp8_weights="keep", **kw)
    ref, want = _run(ref_dir, **kw)
    assert [o.token_ids for o in out] == [o.token_ids for o in want]
    assert _max_logprob_diff(out, want) < 1e-5
    assert eng.precision == "float32+fp8-weights" and ref.precision == "float32"
    lin = eng.runner.linear
    assert isinstance(lin, Fp8Linear) and lin.use_kernel == (mode == "cpu-twins")
    # what is held as FP8: every quantised projection but latent attention's kv_b, codes + scales
    kept = {n: s for n, s in shapes.items() if kept_projection(n)}
    assert all(("kv_b_proj" in n) == (n not in kept) for n in shapes)
    assert lin.nbytes == sum(r * c + r * -(-c // 16) * 4 for r, c in kept.values())
    assert eng.stats.weight_bytes < ref.stats.weight_bytes
    moe = [m for m in eng.runner.model.modules() if isinstance(m, MoeBlock)]
    assert eng.runner.expert_kernel_blocks == (len(moe) if mode == "cpu-twins" else 0)
    for m in eng.runner.model.modules():
        if isinstance(m, MlaAttention):  # the absorbed up-projections hold values, not placeholders
            assert not any(is_placeholder(w.data) for w in [*m.uk_t, *m.uv])
    if mode == "cpu-twins" and moe:
        # the linear's per-expert entries are slices of the kernel's stacks (one copy), the right ones:
        # with the kernel taken out, the experts run one at a time through them, to the same outputs
        for m in moe:
            stack = m.expert_kernel.gate_up.codes
            for i, p in enumerate(m.expert_gate_up):
                f = lin.table[p.data_ptr()]
                assert f.codes.data_ptr() == stack[i].data_ptr()
            m.set_expert_kernel(None)
        again = eng.generate(PROMPTS, SP)
        assert [o.token_ids for o in again] == [o.token_ids for o in want]
        assert _max_logprob_diff(again, want) < 1e-5


@pytest.fixture
def tilelang_if_needed():
    def need():
        from deepinfer_kernels import _tilelang

        if not _tilelang.available():
            pytest.skip("tilelang is not importable")
    return need


def test_kept_fp8_is_batch_invariant_with_chunked_prefill_and_prefix_hits(tmp_path):
    src = make_moe_model(tmp_path / "src", "deepseek_v3", seed=21)
    fp8_dir, _, _ = make_fp8_pair(src, tmp_path)
    eng = Engine(str(fp8_dir), kv_cache_memory=2 << 20, fp8_weights="keep", batch_invariant=True,
                 max_num_batched_tokens=16, block_size=4)
    prompts = ["shared prefix words here and " + p for p in PROMPTS]
    together = eng.generate(prompts, SP)
    for p, t in zip(prompts, together):  # alone, and after the others left their prefix in the cache
        alone = eng.generate([p], SP)[0]
        assert alone.token_ids == t.token_ids
        assert [x.logprob for x in alone.logprobs] == [x.logprob for x in t.logprobs]
    assert eng.stats.cached_prompt_tokens > 0


def test_kept_fp8_mtp_layer_drafts_and_outputs_do_not_change(tmp_path):
    from test_mtp import _with_mtp

    path, _, _ = _with_mtp(tmp_path)
    fp8_dir, ref_dir, shapes = make_fp8_pair(path, tmp_path / "q")
    assert "model.layers.2.eh_proj.weight" in shapes
    eng = Engine(str(fp8_dir), kv_cache_memory=2 << 20, fp8_weights="keep", speculative="mtp")
    assert eng.runner.model.num_mtp_layers == 1
    out = eng.generate(PROMPTS, SP)
    _, want = _run(ref_dir)
    assert [o.token_ids for o in out] == [o.token_ids for o in want]
    assert _max_logprob_diff(out, want) < 1e-5
    assert eng.stats.draft_tokens > 0


def test_auto_dequantises_at_load_on_cpu(pair):
    _, fp8_dir, _, _ = pair
    eng = Engine(str(fp8_dir), kv_cache_memory=2 << 20)
    assert eng.precision == "float32" and not isinstance(eng.runner.linear, Fp8Linear)
    assert not eng.runner.model.fp8_weights


def test_bad_settings_are_named(tmp_path):
    with pytest.raises(InvalidRequestError, match="fp8_weights must be 'auto', 'keep' or 'dequantize', got 'fp16'"):
        EngineConfig(fp8_weights="fp16")
    src = make_moe_model(tmp_path / "src", "qwen3_moe", seed=3)
    with pytest.raises(InvalidRequestError, match="fp8_weights='keep' is not supported with expert_parallel_size > 1"):
        Engine(str(src), kv_cache_memory=2 << 20, fp8_weights="keep", expert_parallel_size=2)


def test_bf16_dot_products_and_kept_fp8_are_refused_by_name(pair):
    _, fp8_dir, _, _ = pair
    with pytest.raises(InvalidRequestError, match="dtype='bfloat16' on CPU .* does not combine with fp8_weights='keep'"):
        Engine(str(fp8_dir), kv_cache_memory=2 << 20, fp8_weights="keep", dtype="bfloat16")
    eng = Engine(str(fp8_dir), kv_cache_memory=2 << 20, dtype="bfloat16")  # auto: dequantised, then bf16 dots
    assert not eng.runner.model.fp8_weights


def test_a_checkpoint_without_fp8_ignores_keep(tmp_path):
    src = make_moe_model(tmp_path / "src", "qwen3_moe", seed=3)
    eng = Engine(str(src), kv_cache_memory=2 << 20, fp8_weights="keep")
    assert eng.precision == "float32" and not eng.runner.model.fp8_weights


def test_a_kernel_with_wrong_results_is_caught_at_install(tmp_path, monkeypatch, tilelang_if_needed):
    """Each FP8 kernel is checked against its torch definition when installed: a wrong one raises under
    kernels="tilelang" and, under "auto", warns and is not used (the weights are dequantised per call)."""
    tilelang_if_needed()
    import deepinfer.engine.fp8_linear as fl
    from deepinfer_kernels import fp8_gemm

    fp8_dir, ref_dir, _ = make_fp8_pair(make_moe_model(tmp_path / "src", "qwen3_moe", seed=21), tmp_path)
    good_dense, good_experts = fp8_gemm.fp8_gemm_tilelang, fp8_gemm.moe_experts
    monkeypatch.setattr(fp8_gemm, "fp8_gemm_tilelang", lambda *a, **k: good_dense(*a, **k) * 1.5)
    with pytest.raises(RuntimeError, match=r"the FP8 kernel on \[\d+, \d+\] at 3 rows disagrees with its torch definition"):
        Engine(str(fp8_dir), kv_cache_memory=2 << 20, fp8_weights="keep", kernels="tilelang")
    monkeypatch.setattr(fp8_gemm, "fp8_gemm_tilelang", good_dense)
    monkeypatch.setattr(fp8_gemm, "moe_experts", lambda x, idx, gu, dn: good_experts(x, idx.flip(1), gu, dn))
    with pytest.raises(RuntimeError, match="the grouped FP8 expert kernel disagrees"):
        Engine(str(fp8_dir), kv_cache_memory=2 << 20, fp8_weights="keep", kernels="tilelang")
    # "auto" where the kernel would run (forced here on CPU): a warning, and outputs still right
    monkeypatch.setattr(fp8_gemm, "moe_experts", good_experts)
    monkeypatch.setattr(fp8_gemm, "fp8_gemm_tilelang", lambda *a, **k: good_dense(*a, **k) * 1.5)
    monkeypatch.setattr(fl, "kernel_runs", lambda *a, **k: True)
    with pytest.warns(RuntimeWarning, match="the TileLang FP8 kernel is unavailable .*disagrees"):
        eng, out = _run(fp8_dir, fp8_weights="keep")
    assert not eng.runner.linear.use_kernel
    _, want = _run(ref_dir)
    assert [o.token_ids for o in out] == [o.token_ids for o in want]
    # and a wrong grouped kernel under "auto": a warning, every block on the per-expert path, outputs right
    monkeypatch.setattr(fp8_gemm, "fp8_gemm_tilelang", good_dense)
    monkeypatch.setattr(fp8_gemm, "moe_experts", lambda x, idx, gu, dn: good_experts(x, idx.flip(1), gu, dn))
    with pytest.warns(RuntimeWarning, match="the TileLang grouped FP8 expert GEMM is unavailable .*disagrees"):
        eng, out = _run(fp8_dir, fp8_weights="keep")
    assert eng.runner.expert_kernel_blocks == 0 and eng.runner.linear.use_kernel
    assert all(m.expert_kernel is None for m in eng.runner.model.modules() if isinstance(m, MoeBlock))
    assert [o.token_ids for o in out] == [o.token_ids for o in want]


def test_many_rows_go_through_the_dequantised_weight_not_the_kernel():
    """Fp8Linear runs the W8A16 kernel below KERNEL_MAX_ROWS rows (decode) and from there dequantises the
    weight for the call into the base linear (prefill chunks: cuBLAS is faster there on an H200); both
    give the dequantised weight's product. Kernel and base stand in here as recorders."""
    import torch

    import deepinfer.engine.fp8_linear as fl
    from deepinfer.engine.loader.fp8_blocks import Fp8Weight
    from deepinfer_kernels import fp8_gemm
    from fp8_factory import quantize

    g = torch.Generator().manual_seed(0)
    codes, scale_inv = quantize(torch.randn(24, 40, generator=g), (16, 16))
    f = Fp8Weight.from_blocks(codes, scale_inv, (16, 16))
    placeholder = torch.empty(24, 40)
    calls = []

    def kernel(x, c, s, bk):
        calls.append(("kernel", x.shape[0]))
        return fp8_gemm.fp8_gemm_reference(x, c, s, bk)

    def base(x, w, b=None):
        calls.append(("base", x.shape[:-1], w.data_ptr() == placeholder.data_ptr()))
        return torch.nn.functional.linear(x, w, b)

    lin = fl.Fp8Linear({placeholder.data_ptr(): f}, base, use_kernel=True)
    lin._gemm = kernel
    n = fl.KERNEL_MAX_ROWS
    for shape in ((n - 1, 40), (n, 40), (2, n // 2, 40), (1, 40)):
        x = torch.randn(*shape, generator=g)
        calls.clear()
        y = lin(x, placeholder)
        torch.testing.assert_close(y, torch.nn.functional.linear(x, f.dequantize()), rtol=1e-5, atol=1e-5)
        rows = x.numel() // 40
        assert calls == ([("kernel", rows)] if rows < n else [("base", x.shape[:-1], False)])
    other = torch.randn(8, 40)  # not a kept weight: the base linear, as it is
    calls.clear()
    lin(torch.randn(3, 40), other)
    assert calls == [("base", (3,), False)]
