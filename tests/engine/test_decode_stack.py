"""The native decode stack (deepinfer_kernels.decode_stack, bound by engine/native_decode.py) against the
per-op path it replaces for steps of few query tokens (decodes, short prefills, draft verification): the
same hidden states, logits and KV-cache contents, bit for bit, on tiny random-weight models: with GGUF
block weights in the exact and int8 modes, and on the native panel GEMM (fp32 and 16-bit checkpoints,
dense and Qwen3-MoE)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.loader import load_model
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.weights16 import bf16_dot_available
from deepinfer_kernels import KernelInputError, quant
from deepinfer_kernels.decode_stack import DecodeStack

if not quant.available():
    pytest.skip("no C compiler here: the native kernels are not built", allow_module_level=True)

BS = 4  # small blocks: contexts span several, in scattered order
NEEDS_BF16_DOT = pytest.mark.skipif(not bf16_dot_available(),
                                    reason="dtype='bfloat16' runs bf16 dot products only at the avx512 level (AVX-512F)")


def _runner(path, mode, fmt=quant.Q4_1, batch_invariant=False):
    loaded = load_model(str(path))
    # projections in `fmt`, the (possibly tied) embedding in Q8_0 as in the default GGUF
    blocks = {k: quant.pack(v, quant.Q8_0 if "embed" in k or "lm_head" in k else fmt)
              for k, v in loaded.weights.items() if v.dim() == 2}
    cfg = EngineConfig(kv_cache_memory=2 << 20, block_size=BS, batch_invariant=batch_invariant)
    return ModelRunner(cfg, loaded.config, loaded.weights, torch.device("cpu"), torch.float32,
                       quantized=blocks, quant_mode=mode)


def _tables(rng, n, length):
    """n block tables of distinct, shuffled blocks covering `length` positions each"""
    per = -(-length // BS)
    ids = torch.randperm(n * per + 7, generator=rng)[: n * per].view(n, per)
    return [row.tolist() for row in ids]


def _prefill(runner, tables, prompts):
    """write each sequence's prompt KV through the per-op path (one prefill batch)"""
    batch = ForwardBatch.build(prompts, [0] * len(prompts), tables, [], BS)
    runner.forward(runner.prepare(batch))


AVX2 = quant.cpu_level() >= 1


def _same_as_per_op(runner, batch):
    """Run `batch` through the per-op path, then (its rows' KV zeroed) through the stack: assert the
    stack ran and wrote the same logits and KV cache, bit for bit. Returns the logits."""
    stack = runner.decode_stack
    runner.decode_stack = None
    ref_prep = runner.prepare(batch)
    assert ref_prep.stack_block_tables is None
    ref = runner.forward(ref_prep)
    ref_cache = runner.kv_cache.clone()
    runner.kv_cache[:, :, batch.slot_mapping] = 0  # the stack writes these rows' K and V in every layer
    runner.decode_stack = stack
    prep = runner.prepare(batch)
    assert prep.stack_block_tables is not None
    got = runner.forward(prep)
    assert torch.equal(got, ref), f"{batch.num_tokens} rows: max diff {(got - ref).abs().max()}"
    assert torch.equal(runner.kv_cache, ref_cache)
    return ref


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # qwen2: q|k|v bias, tied embedding; qwen3: q/k norms
@pytest.mark.parametrize("mode,invariant", [("exact", False), ("exact", True), ("bf16", False), ("int8", False)],
                         ids=["exact", "exact-invariant", "bf16", "int8"])
def test_stack_is_bitwise_the_per_op_path(tiny_models, arch, mode, invariant):
    runner = _runner(tiny_models[arch], mode, batch_invariant=invariant)
    stack = runner.decode_stack
    assert stack is not None and stack.mode == ("int8" if mode == "int8" else "exact")
    # kv_cache_dtype "auto": the approximate modes' caches are bf16 (csrc/*_bf16 in the stack)
    assert runner.kv_cache.dtype == (torch.bfloat16 if mode in ("bf16", "int8") else torch.float32)
    rng = torch.Generator().manual_seed(7)
    # every step up to max_num_seqs rows, with QuantLinear's kernel at each row count: from 16 rows the
    # int8 mode's vpdpbusd outer kernel, the exact mode's panel (batch-invariant) or outer-product
    # kernel, the bf16 mode's bf16 kernel (without AVX2 the exact modes stop below PANEL_M rows)
    many = AVX2 or mode == "int8"
    n = 2 * quant.PANEL_M + 3 if many else quant.PANEL_M - 1
    assert stack.max_rows == (runner.config.max_num_seqs if many else n)
    if many and mode != "int8":
        assert stack.many == ("panel" if invariant else "bf16" if mode == "bf16" else "outer")
    lens = torch.randint(3, 40, (n,), generator=rng).tolist()
    tables = _tables(rng, n, max(lens) + 1)
    vocab = runner.model_config.vocab_size
    _prefill(runner, tables, [torch.randint(0, vocab, (L,), generator=rng).tolist() for L in lens])
    for rows in (1, 3, quant.PANEL_M, n) if many else (1, 3, n):
        toks = torch.randint(0, vocab, (rows,), generator=rng).tolist()
        batch = ForwardBatch.build([[t] for t in toks], lens[:rows], tables[:rows], list(range(rows)), BS)
        ref = _same_as_per_op(runner, batch)
        # an early exit (self-drafting) runs the first layers, then the final norm
        runner.decode_stack = None
        ref1 = runner.forward(runner.prepare(batch), num_layers=1)
        runner.decode_stack = stack
        assert torch.equal(runner.forward(runner.prepare(batch), num_layers=1), ref1)
        assert not torch.equal(ref1, ref)


@pytest.mark.parametrize("mode", ["exact", "int8"])
def test_prefill_and_verify_runs_go_through_the_stack_bitwise(tiny_models, mode):
    """Several query tokens per sequence (a fresh prompt, a chunk after a cached prefix, a decode with
    draft tokens to verify) beside plain decodes: one row per token, each attending to its own
    position's prefix, as token_attention computes such runs on the per-op path."""
    runner = _runner(tiny_models["qwen2"], mode)
    rng = torch.Generator().manual_seed(11)
    vocab = runner.model_config.vocab_size
    tables = _tables(rng, 4, 40)
    cached = [9, 14, 6]
    _prefill(runner, tables[:3], [torch.randint(0, vocab, (n,), generator=rng).tolist() for n in cached])
    toks = lambda n: torch.randint(0, vocab, (n,), generator=rng).tolist()  # noqa: E731
    # a decode, a 4-token verify run, a 3-token chunk after a cached prefix, a fresh 5-token prompt
    batch = ForwardBatch.build([toks(1), toks(4), toks(3), toks(5)], cached + [0], tables, [0, 1, 2, 3, 4, 7, 12], BS)
    assert batch.num_tokens == 13 < quant.PANEL_M
    _same_as_per_op(runner, batch)
    # a whole short prompt alone (the first step of a request)
    _same_as_per_op(runner, ForwardBatch.build([toks(7)], [0], tables[3:], [6], BS))


@pytest.mark.parametrize("mode", ["exact", "int8"])
def test_steps_the_stack_does_not_compute_take_the_per_op_path(tiny_models, mode):
    runner = _runner(tiny_models["llama"], mode)
    rng = torch.Generator().manual_seed(3)
    top = runner.decode_stack.max_rows
    # a chunk SDPA computes (long, with context): not token attention's, so not the stack's
    long = 65
    tables = _tables(rng, 1, long + 1)
    batch = ForwardBatch.build([[3] * long], [0], tables, [long - 1], BS)
    assert long * long > 4096
    assert runner.prepare(batch).stack_block_tables is None
    # more tokens than the stack holds
    n = top + 1
    tables = _tables(rng, n, 12)
    _prefill(runner, tables, [[5] * 8] * n)
    decode = ForwardBatch.build([[1]] * n, [8] * n, tables, list(range(n)), BS)
    assert runner.prepare(decode).stack_block_tables is None
    assert runner.prepare(ForwardBatch.build([[1]] * top, [8] * top, tables[:top], list(range(top)), BS)
                          ).stack_block_tables is not None


def test_stack_binds_only_models_it_computes_exactly(tiny_models, moe_models):
    assert _runner(tiny_models["qwen3"], "exact").decode_stack is not None  # q/k norms in rope_store_kv, as per-op
    assert _runner(tiny_models["llama"], "exact", batch_invariant=True).decode_stack is not None
    fp32 = _panel_engine(tiny_models["llama"]).runner
    assert (fp32.decode_stack is not None) == (fp32.linear.backend == "native")
    from deepinfer.engine.cpu_linear import CpuLinear, onednn_available
    from deepinfer.engine.native_decode import bind_decode_stack

    if onednn_available():  # oneDNN's packed weights: not the stack's kernels, so the per-op path
        onednn = CpuLinear(fp32.model.linear_weights(), backend="onednn")
        assert bind_decode_stack(fp32.model, onednn, fp32.kv_caches, BS, 8) is None
        assert bind_decode_stack(fp32.model, fp32.linear, fp32.kv_caches, BS, 8) is not None
    # a shared expert that does not fuse (48 wide beside 32-wide routed experts) keeps the per-op path;
    # Qwen2-MoE's gated one that fuses does not (test_gated_shared_expert_stack_is_bitwise_the_per_op_path)
    assert _panel_engine(moe_models["qwen2_moe"]).runner.decode_stack is None


# ---- the panel GEMM (fp32 / 16-bit checkpoints), dense and MoE ------------------------------------

@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from moe_factory import make_moe_model

    root = tmp_path_factory.mktemp("stack_moe")
    models = {a: make_moe_model(root / a, a, seed=2) for a in ("qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2")}
    # a shared expert twice a routed expert's width (Qwen1.5-MoE's is 4x): it fuses, with its gate
    models["qwen2_moe_fused"] = make_moe_model(root / "q2f", "qwen2_moe", seed=2, shared_expert_intermediate_size=64)
    # no q_lora (a plain q projection), rope pairs not interleaved, plain rope, no group-limited routing
    models["deepseek_v3_plain"] = make_moe_model(root / "v3_plain", "deepseek_v3", seed=2, q_lora_rank=None,
                                                 rope_interleave=False, n_group=1, topk_group=1,
                                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    return models


def _panel_engine(path, **kw):
    from deepinfer import Engine

    return Engine(str(path), block_size=BS, kv_cache_memory=16 << 20, **kw)


def _steps_match(runner, row_counts, seed=5):
    """prefill max(row_counts) sequences through the per-op path, then decode steps of each row count
    through both paths (see _same_as_per_op), and an early exit"""
    rng = torch.Generator().manual_seed(seed)
    n = max(row_counts)
    lens = torch.randint(3, 40, (n,), generator=rng).tolist()
    tables = _tables(rng, n, max(lens) + 1)
    vocab = runner.model_config.vocab_size
    _prefill(runner, tables, [torch.randint(0, vocab, (L,), generator=rng).tolist() for L in lens])
    stack = runner.decode_stack
    for rows in row_counts:
        toks = torch.randint(0, vocab, (rows,), generator=rng).tolist()
        batch = ForwardBatch.build([[t] for t in toks], lens[:rows], tables[:rows], list(range(rows)), BS)
        _same_as_per_op(runner, batch)
    runner.decode_stack = None
    ref1 = runner.forward(runner.prepare(batch), num_layers=1)
    runner.decode_stack = stack
    assert torch.equal(runner.forward(runner.prepare(batch), num_layers=1), ref1)


@pytest.mark.parametrize("arch,kw", [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("llama", {"batch_invariant": True}),
                                     pytest.param("qwen3", {"dtype": "bfloat16"}, marks=NEEDS_BF16_DOT)],
                         ids=["llama", "qwen2-bias", "qwen3-qk-norm", "llama-invariant", "qwen3-bf16-dot"])
def test_panel_stack_is_bitwise_the_per_op_path(tiny_models, arch, kw):
    eng = _panel_engine(tiny_models[arch], **kw)
    runner = eng.runner
    assert runner.linear.backend == "native"  # (the panel GEMM is the CPU linear at every level)
    stack = runner.decode_stack
    assert stack is not None and stack.max_rows == runner.config.max_num_seqs
    # the panels the per-op path runs (gate|up packed gated: silu * mul in the GEMM), 16-bit dot products too
    assert any(pw.gated for pw in runner.linear.packed_gated.values())
    if kw.get("dtype") == "bfloat16":
        assert all(pw.bf16_dot for pw in runner.linear.packed.values()) and runner.kv_cache.dtype == torch.bfloat16
    _steps_match(runner, (1, 3, 16, 37))


@pytest.mark.parametrize("kw", [{}, {"batch_invariant": True}, {"moe_expert_dtype": "bfloat16"},
                                pytest.param({"dtype": "bfloat16"}, marks=NEEDS_BF16_DOT)],
                         ids=["fp32", "invariant", "bf16-experts", "bf16-dot"])
def test_moe_stack_is_bitwise_the_per_op_path(moe_models, kw):
    """Qwen3-MoE (layers: MoE, dense (mlp_only_layers), MoE): the router's panels, the native routing and
    one grouped experts call with the slot combine per MoE layer, the dense layer's MLP on the expert
    kernel as one expert; up to 150 rows, so experts also get more rows than the tall tile takes."""
    from deepinfer.engine.expert_kernels import NativeExperts, NativeGatedMlp

    eng = _panel_engine(moe_models["qwen3_moe"], **kw)
    runner = eng.runner
    assert runner.linear.backend == "native"  # (the panel GEMM is the CPU linear at every level)
    assert runner.decode_stack is not None
    mods = list(runner.model.modules())
    assert sum(isinstance(m, NativeExperts) for m in mods) == 2 and any(isinstance(m, NativeGatedMlp) for m in mods)
    if "moe_expert_dtype" in kw:
        assert all(m.weights == torch.bfloat16 for m in mods if isinstance(m, NativeExperts))
    _steps_match(runner, (1, 5, 40, 150))


@pytest.mark.parametrize("kw", [{}, {"batch_invariant": True}], ids=["fp32", "invariant"])
def test_gated_shared_expert_stack_is_bitwise_the_per_op_path(moe_models, kw):
    """Qwen2-MoE: the shared expert's chunks in the routed experts' call, their slots weighted by
    sigmoid(x . shared_expert_gate) (the gate's panels, the native sigmoid), as MoeBlock.forward runs it."""
    from deepinfer.engine.models.moe import MoeBlock

    eng = _panel_engine(moe_models["qwen2_moe_fused"], **kw)
    runner = eng.runner
    assert runner.linear.backend == "native"  # (the panel GEMM is the CPU linear at every level)
    assert runner.decode_stack is not None
    blocks = [m for m in runner.model.modules() if isinstance(m, MoeBlock)]
    assert blocks and all(b.shared_gate_weight is not None and b.expert_kernel.can_fuse(b.shared) for b in blocks)
    _steps_match(runner, (1, 5, 40, 150))


@pytest.mark.parametrize("arch,kw", [("deepseek_v3", {}), ("deepseek_v3", {"batch_invariant": True}),
                                     pytest.param("deepseek_v3", {"dtype": "bfloat16"}, marks=NEEDS_BF16_DOT),
                                     ("deepseek_v3_plain", {}),
                                     ("deepseek_v2", {})],
                         ids=["v3", "v3-invariant", "v3-bf16-dot", "v3-no-q-lora", "v2"])
def test_latent_stack_is_bitwise_the_per_op_path(moe_models, arch, kw):
    """DeepSeek-V3 (layers: dense, then MoE with a shared expert; latent attention with q_lora, YaRN and
    interleaved rope; or a plain q projection and rotate-half rope; V2's softmax routing): q_a / q_b /
    kv_a panels, the native rope and cache entries, each head's absorbed projections, the attention over
    the latent entries, and the shared expert's chunks in the routed experts' call; the per-op path
    computes the absorbed projections per head at every row count (absorb_per_head)."""
    from deepinfer.engine.models.mla import MlaAttention

    eng = _panel_engine(moe_models[arch], **kw)
    runner = eng.runner
    assert runner.linear.backend == "native"  # (the panel GEMM is the CPU linear at every level)
    assert runner.decode_stack is not None
    attns = [m for m in runner.model.modules() if isinstance(m, MlaAttention)]
    assert attns and all(a.absorb_per_head for a in attns)
    assert all((a.q_lora is None, a.interleave) == (arch == "deepseek_v3_plain", arch != "deepseek_v3_plain")
               for a in attns)
    assert any(ly.mlp.shared is not None for ly in runner.model.layers if hasattr(ly.mlp, "shared"))
    _steps_match(runner, (1, 5, 40, 150))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_moe_stack_gives_the_per_op_tokens_end_to_end(moe_models, arch):
    from deepinfer import SamplingParams

    eng = _panel_engine(moe_models[arch])
    assert eng.runner.decode_stack is not None
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 14, 3], [7, 7, 21], [30, 2, 8, 11, 4, 6]]
    got = eng.generate(prompts, sp)
    eng.runner.decode_stack = None
    eng.reset_prefix_cache()
    ref = eng.generate(prompts, sp)
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
        assert [(l.logprob, l.top) for l in a.logprobs] == [(l.logprob, l.top) for l in b.logprobs]


def test_stack_rejects_a_bad_moe_layer(moe_models):
    from deepinfer_kernels.decode_stack import StackLayer, StackMoe

    eng = _panel_engine(moe_models["qwen3_moe"])
    stack = eng.runner.decode_stack
    assert stack is not None
    from deepinfer.engine.native_decode import bind_decode_stack

    runner = eng.runner
    model = runner.model
    layer = model.layers[0]
    lin = runner.linear
    attn, block = layer.self_attn, layer.mlp
    base = dict(in_norm=layer.input_layernorm.weight.data, post_norm=layer.post_attention_layernorm.weight.data,
                qkv=lin.packed[attn.qkv_weight.data_ptr()], qkv_bias=None, o=lin.packed[attn.o_weight.data_ptr()],
                gate_up=None, down=None, k_cache=runner.kv_caches[0][0], v_cache=runner.kv_caches[0][1],
                q_norm=attn.q_norm.weight.data, k_norm=attn.k_norm.weight.data)
    router = lin.packed[block.gate_weight.data_ptr()]
    packed = block.expert_kernel._packed
    rot = model.rotary
    make = lambda moe: DecodeStack([StackLayer(**base, moe=moe)], model.norm.weight.data, rot.cos, rot.sin,  # noqa: E731
                                   1e-6, attn.n_heads, BS, "exact", 4)
    assert make(StackMoe(router, packed, 2)).num_layers == 1
    with pytest.raises(KernelInputError, match="do not fit 8 experts"):
        make(StackMoe(router, packed, 9))
    with pytest.raises(KernelInputError, match="one expert, top_k 1"):
        make(StackMoe(None, packed, 2))
    with pytest.raises(KernelInputError, match="scoring"):
        make(StackMoe(router, packed, 2, scoring="relu"))
    with pytest.raises(KernelInputError, match="gate_up is None"):
        make(None)
    assert bind_decode_stack(model, lin, runner.kv_caches, BS, 8) is not None


def test_stack_rejects_bad_steps(tiny_models):
    runner = _runner(tiny_models["llama"], "exact")
    stack = runner.decode_stack
    x = torch.randn(2, stack.hidden)
    pos, slots = torch.tensor([3, 9]), torch.tensor([3, 9])
    bt = torch.tensor([[0, 1, 2], [0, 1, 2]])
    with pytest.raises(KernelInputError, match="block table"):
        stack(x, pos, slots, bt[:, :2].contiguous())  # position 9 is in block 2
    with pytest.raises(KernelInputError, match="KV slot"):
        stack(x, pos, torch.tensor([3, 1 << 40]), bt)
    with pytest.raises(KernelInputError, match="KV slot"):
        stack(x, pos, slots, torch.tensor([[0, 1, 2], [0, 1, 1 << 40]]))
    m = stack.max_rows + 1
    with pytest.raises(KernelInputError, match=f"M <= {stack.max_rows}"):
        stack(torch.randn(m, stack.hidden), torch.zeros(m, dtype=torch.long), torch.zeros(m, dtype=torch.long),
              torch.zeros(m, 1, dtype=torch.long))
    with pytest.raises(KernelInputError, match="many must be one of"):
        DecodeStack([], torch.ones(1), torch.ones(1), torch.ones(1), 1e-6, 4, BS, "exact", many="fast")
    with pytest.raises(KernelInputError, match="positions"):
        stack(x, pos.int(), slots, bt)
    with pytest.raises(KernelInputError, match="layer count"):
        stack(x, pos, slots, bt, num_layers=stack.num_layers + 1)
