"""The MoE block's expert paths: the native grouped GEMM the runner installs on CPU fp32 against the
per-expert GEMM path, its place in the runner (experts not packed twice), and a block holding a
subset of the experts (`local_experts`)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import Engine, SamplingParams
from deepinfer.engine.attention import ForwardContext
from deepinfer.engine.models.moe import MoeBlock
from deepinfer.engine.moe_config import MoeConfigError
from deepinfer_kernels import moe_gemm
from moe_factory import make_moe_model

pytest.importorskip("transformers")
needs_native = pytest.mark.skipif(not moe_gemm.available(), reason="no C compiler: native kernels not built")


@pytest.fixture(scope="module")
def v3_path(tmp_path_factory):
    return make_moe_model(tmp_path_factory.mktemp("moe_experts") / "v3", "deepseek_v3", seed=3)


def _blocks(eng: Engine) -> list[MoeBlock]:
    return [m for m in eng.runner.model.modules() if isinstance(m, MoeBlock)]


def _ctx(eng: Engine) -> ForwardContext:
    lin = eng.runner.linear
    return ForwardContext(slot_mapping=torch.empty(0, dtype=torch.long), linear=lin, silu_mul=getattr(lin, "silu_mul", None))


@needs_native
def test_runner_installs_the_native_experts_and_packs_them_once(v3_path):
    eng = Engine(str(v3_path), kv_cache_memory=1 << 20)
    blocks = _blocks(eng)
    assert blocks and eng.runner.expert_kernel_blocks == len(blocks)
    assert all(b.expert_kernel is not None for b in blocks)
    packed = set(getattr(eng.runner.linear, "packed", {})) | set(getattr(eng.runner.linear, "packed_gated", {}))
    experts = {w.data_ptr() for b in blocks for w in list(b.expert_gate_up) + list(b.expert_down)}
    assert packed and not packed & experts, "expert weights were also packed for the linear"
    # kernels="torch" keeps the per-expert GEMMs
    assert Engine(str(v3_path), kv_cache_memory=1 << 20, kernels="torch").runner.expert_kernel_blocks == 0


@needs_native
@pytest.mark.parametrize("tokens", [1, 3, 17, 64])
def test_native_experts_match_the_per_expert_path(v3_path, tokens):
    eng = Engine(str(v3_path), kv_cache_memory=1 << 20)
    block = _blocks(eng)[0]
    meta = _ctx(eng)
    x = torch.randn(tokens, block.hidden, generator=torch.Generator().manual_seed(tokens))
    w, idx = block.route(x, meta)
    native = block.grouped_experts(x, idx, meta)
    kernel = block.expert_kernel
    block.set_expert_kernel(None)
    try:
        per_expert = block.grouped_experts(x, idx, meta)
    finally:
        block.set_expert_kernel(kernel)
    torch.testing.assert_close(native, per_expert, atol=2e-5, rtol=1e-4)


def test_greedy_tokens_agree_with_the_torch_kernels(v3_path):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["the quick brown fox", "hello world", "a b c d e f"]
    ours = Engine(str(v3_path), kv_cache_memory=2 << 20).generate(prompts, sp)
    ref = Engine(str(v3_path), kv_cache_memory=2 << 20, kernels="torch").generate(prompts, sp)
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref]


@pytest.mark.parametrize("native", [False, True])
def test_a_block_holding_a_subset_of_experts(v3_path, native):
    if native and not moe_gemm.available():
        pytest.skip("no C compiler: native kernels not built")
    # (no packed copies: the block's own weight values are what the sub-block is built from)
    eng = Engine(str(v3_path), kv_cache_memory=1 << 20, kernels="torch", cpu_prepack=False)
    full = _blocks(eng)[0]
    local = [5, 1, 6]
    sub = MoeBlock(full.hidden, full.moe, local_experts=local)
    for i, e in enumerate(local):
        sub.expert_gate_up[i].data = full.expert_gate_up[e].data
        sub.expert_down[i].data = full.expert_down[e].data
    if native:
        from deepinfer.engine.expert_kernels import install_native_experts

        assert install_native_experts(sub) == 1
    meta = _ctx(eng)
    x = torch.randn(7, full.hidden, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([[5, 1], [6, 5], [1, 6], [6, 1], [5, 6], [1, 5], [6, 5]])  # global ids
    torch.testing.assert_close(sub.grouped_experts(x, idx, meta), full.grouped_experts(x, idx, meta), atol=2e-5, rtol=1e-4)
    with pytest.raises(MoeConfigError, match=r"routed to experts \[0, 7\], which this block does not hold"):
        sub.grouped_experts(x[:2], torch.tensor([[5, 0], [7, 1]]), meta)
    with pytest.raises(MoeConfigError, match="local_experts must be distinct expert ids"):
        MoeBlock(full.hidden, full.moe, local_experts=[1, 1])
    with pytest.raises(MoeConfigError, match="local_experts must be distinct expert ids"):
        MoeBlock(full.hidden, full.moe, local_experts=[full.moe.num_experts])


@needs_native
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_shared_and_dense_mlps_run_on_the_native_kernel(v3_path, tokens):
    from deepinfer.engine.models.layers import GatedMLP

    eng = Engine(str(v3_path), kv_cache_memory=1 << 20)
    mlps = [m for m in eng.runner.model.modules() if isinstance(m, GatedMLP)]
    shared = [b.shared for b in _blocks(eng) if b.shared is not None]
    # the V3 model has dense first layers and shared experts: all of them on the kernel
    assert shared and len(mlps) > len(shared) and all(m.kernel is not None for m in mlps)
    # and none packed a second time for the linear
    packed = set(getattr(eng.runner.linear, "packed", {})) | set(getattr(eng.runner.linear, "packed_gated", {}))
    assert not packed & {w.data_ptr() for m in mlps for w in (m.gate_up_weight, m.down_weight)}
    meta = _ctx(eng)
    x = torch.randn(tokens, mlps[0].down_weight.shape[0], generator=torch.Generator().manual_seed(tokens))
    # the torch definition on the checkpoint's tensors (the kernels' panels are the engine's only copy)
    from safetensors.torch import load_file

    ckpt = load_file(str(v3_path / "model.safetensors"))
    names = {id(m): n for n, m in eng.runner.model.named_modules()}
    block = next(b for b in _blocks(eng) if b.shared is shared[0])
    prefixes = {id(mlps[0]): "model." + names[id(mlps[0])] + ".",
                id(shared[0]): "model." + names[id(block)] + f".{block.shared_name}."}
    for m in (mlps[0], shared[0]):
        got = m(x, meta)
        p = prefixes[id(m)]
        g, u = x @ ckpt[p + "gate_proj.weight"].t(), x @ ckpt[p + "up_proj.weight"].t()
        ref = (torch.nn.functional.silu(g) * u) @ ckpt[p + "down_proj.weight"].t()
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        # a row's bits do not depend on the batch it is in
        assert torch.equal(m(x[-1:], meta)[0], got[-1])


@needs_native
def test_dense_models_keep_their_mlps_on_the_linear(tmp_path):
    from deepinfer.engine.models.layers import GatedMLP
    from model_factory import make_tiny_model

    eng = Engine(str(make_tiny_model(tmp_path / "dense", "llama")), kv_cache_memory=1 << 20)
    mlps = [m for m in eng.runner.model.modules() if isinstance(m, GatedMLP)]
    assert mlps and all(m.kernel is None for m in mlps)


@needs_native
def test_packed_experts_are_the_only_copy_and_give_the_weights_back(v3_path):
    """After packing, the expert parameters are empty (the panels are the one copy in memory); the
    block's stacked weights, read back from the panels, are the checkpoint's, bit for bit."""
    from safetensors.torch import load_file

    ckpt = load_file(str(v3_path / "model.safetensors"))
    eng = Engine(str(v3_path), kv_cache_memory=1 << 20)
    layers = [(i, layer.mlp) for i, layer in enumerate(eng.runner.model.layers) if isinstance(layer.mlp, MoeBlock)]
    assert layers
    for i, b in layers:
        assert all(p.numel() == 0 for p in list(b.expert_gate_up) + list(b.expert_down))
        gu, down = b.stacked_expert_weights()
        for e in (0, len(b.local_experts) - 1):
            pre = f"model.layers.{i}.mlp.experts.{e}."
            want_gu = torch.cat([ckpt[pre + "gate_proj.weight"], ckpt[pre + "up_proj.weight"]]).float()
            assert torch.equal(gu[e], want_gu) and torch.equal(down[e], ckpt[pre + "down_proj.weight"].float())
    # packed once: the engine holds well under twice the checkpoint (it held 2.12x on the V3-shaped
    # benchmark model with the parameters kept beside the panels)
    assert eng.stats.weight_bytes < 2 * eng.stats.checkpoint_bytes


class _Unfused(torch.nn.Module):
    """An expert kernel without `combined`: MoeBlock then combines the slots and adds the shared
    expert in torch (the path the fused call replaces)."""

    def __init__(self, kernel):
        super().__init__()
        self.kernel = kernel

    def forward(self, x, idx):
        return self.kernel(x, idx)


@needs_native
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_the_fused_call_gives_the_torch_combines_bits(v3_path, tokens):
    """Experts, slot combine and shared expert in one native call: bitwise the block's torch combine
    (products rounded, summed in slot order, + shared) over the same kernel's per-slot rows."""
    eng = Engine(str(v3_path), kv_cache_memory=1 << 20)
    block = _blocks(eng)[0]
    assert block.shared is not None and block.expert_kernel.can_fuse(block.shared)  # V3: the shared expert runs inside
    meta = _ctx(eng)
    x = torch.randn(tokens, block.hidden, generator=torch.Generator().manual_seed(tokens))
    fused = block(x, meta)
    kernel = block.expert_kernel
    block.set_expert_kernel(_Unfused(kernel))
    try:
        ref = block(x, meta)
    finally:
        block.set_expert_kernel(kernel)
    assert torch.equal(fused, ref)


@needs_native
def test_a_shared_expert_packed_in_chunks(v3_path):
    """A shared expert wider than the routed ones runs as chunks of their size (summed), near the
    plain MLP; a chunk that does not divide the width is refused."""
    from deepinfer.engine.expert_kernels import NativeGatedMlp

    g = torch.Generator().manual_seed(0)
    H, inter = 64, 96
    gu, down = torch.randn(2 * inter, H, generator=g) * 0.1, torch.randn(H, inter, generator=g) * 0.1
    x = torch.randn(9, H, generator=g)
    plain, chunked = NativeGatedMlp(gu, down), NativeGatedMlp(gu, down, chunk=32)
    assert chunked.chunks.num_experts == 3 and chunked.chunks.inter == 32
    torch.testing.assert_close(chunked(x), plain(x), atol=2e-5, rtol=1e-4)
    assert torch.equal(chunked(x[3:4])[0], chunked(x)[3])  # batch-invariant
    with pytest.raises(ValueError, match="chunk 40 does not divide the intermediate size 96"):
        NativeGatedMlp(gu, down, chunk=40)
