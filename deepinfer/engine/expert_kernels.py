"""Which kernel runs the routed experts of every MoE block: one grouped-GEMM call per layer.

* CPU fp32: the native grouped GEMM (deepinfer_kernels.moe_gemm). `install_expert_kernels` packs
  each MoeBlock's experts once at load (stacked, in the kernel's panels). Installed before the
  runner builds its CpuLinear, so the experts' weights are packed once, here, not also for the linear.
* CUDA: the TileLang grouped GEMM (deepinfer_kernels.grouped_gemm), on the experts' weights stacked
  [E, 2I, H] / [E, H, I]; the per-expert parameters become views of the stacks (no second copy).
  Compiled at install; a failed compile keeps the per-expert GEMMs (with a warning) under
  kernels="auto" and raises under kernels="tilelang". 16-bit engines only under "auto": the
  kernel's T.gemm runs fp32 operands on the tensor cores as TF32 (10-bit mantissas). Measured on
  an H200 (scripts/gpu_engine_check.py, tiny fp32 MoE models against fp32 transformers): max
  logprob difference 0.9-3.7e-3 with the kernel, 4.8-9.5e-7 with torch's fp32 per-expert GEMMs, so
  an fp32 engine keeps those; kernels="tilelang" still installs it, with a warning.
* CPU fp32, the MoE model's other gated MLPs (shared experts, the dense first layers): the same
  native kernel as a one-expert stack (NativeGatedMlp, installed as GatedMLP.kernel), which beat
  oneDNN's packed silu_mul + down pair on this AVX2 CPU (its 4 x 24 tile; the shared native GEMM
  is AVX-512-only here). Dense models keep their MLPs on the linear.

Why (2-core AVX2 EPYC, shared and loaded, so ratios only): the per-expert path (argsort,
index_select, a oneDNN gate/up and down call per active expert, index_copy) measured 1.2-2.8x slower
per DeepSeek-V3-shaped layer (32 experts of 1024 x 256, top-4, weights from memory, 1 thread) than one
native call at 1-32 tokens. On a quiet machine (benchmarks/moe.py, 2 threads) the grouped kernel
runs the Qwen3-MoE-shaped model 1.89x / 1.77x faster than the per-expert path at batch 8 / 32 (side
by side, --per-expert), and the V3-shaped model at 1.97x / 1.88x transformers; the kernel reaches
0.57 of oneDNN's dense GFLOP/s on the same work. (Figures taken under load looked 2-3x better for
us: transformers' many small multi-threaded calls collapse under contention.)
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


class NativeExperts(nn.Module):
    """One MoE block's experts packed for `moe_gemm.moe_experts`; callable (x, local ids) -> [T, k, H].
    The packed panels are non-persistent buffers, so the runner's weight_bytes counts them."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.dtype = torch.float32,
                 bf16_dot: bool = False):
        """weights: the panels' storage (fp32, or bf16 widened exactly); bf16_dot: bf16 pair panels run
        as bf16 dot products instead (x and the gated intermediate rounded to bf16, fp32 accumulation:
        Engine(dtype="bfloat16"))."""
        super().__init__()
        from deepinfer_kernels import moe_gemm

        self._kernel = moe_gemm.moe_experts
        p = moe_gemm.pack_experts_bf16_dot(gate_up, down) if bf16_dot else moe_gemm.pack_experts(gate_up, down, weights=weights)
        self.register_buffer("packed_gate_up", p.gate_up, persistent=False)
        self.register_buffer("packed_down", p.down, persistent=False)
        self._packed = p
        self.weights = p.weights
        self.bf16_dot = bf16_dot

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, idx, self._packed)

    def repacked(self, block) -> "NativeExperts":
        """This kernel rebuilt over the experts `block` holds now (after MoeBlock.swap_experts). A
        method, so the block rebuilds its kernel without importing this module (which imports it)."""
        return NativeExperts(*block.stacked_expert_weights(), weights=self.weights, bf16_dot=self.bf16_dot)

    def can_fuse(self, mlp) -> bool:
        """Whether `combined` can run the gated MLP `mlp` (a shared expert) in its call: its kernel holds
        it as chunks of this stack's shape and storage."""
        chunks = getattr(getattr(mlp, "kernel", None), "chunks", None)
        p = self._packed
        return chunks is not None and (chunks.hidden, chunks.inter, chunks.weights, chunks.bf16_dot) == \
            (p.hidden, p.inter, p.weights, p.bf16_dot)

    def combined(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, shared=None,
                 add: torch.Tensor | None = None, shared_weight: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H]: sum_j w[t, j] * expert idx[t, j] (x[t]) in slot order, in one native call, then
        + the shared gated MLP `shared` (one whose `can_fuse`: its chunks run in the same call, as extra
        groups, so no second call and no second pass over the output; each chunk's slot weighted 1, or
        shared_weight [T, 1]: Qwen2-MoE's gate) or + add.

        Why: at a batch-32 decode step of the V3-shaped model the torch combine (a [T, k, H] multiply,
        k - 1 adds, + shared) and the shared expert's own call cost 0.3 + 1.05 ms per layer next to the
        routed experts' 7.2 ms (1 thread, replayed layer inputs): the fused call hides the shared
        expert's FLOPs in the routed experts' weight streaming. End to end (benchmarks/moe.py's models,
        2 threads, quiet window, paired A/B against the engine before this call and the native routing,
        best of 4): V3-shaped 1.02x at batch 32, 1.13x at 128, 1.03x at 8 and 1; Qwen3-shaped (no shared
        expert) 0.98x at 32 (within the noise), 1.04-1.08x at 128."""
        extra = None
        if shared is not None:
            extra = shared.kernel.chunks
            t, m = x.shape[0], extra.num_experts
            ids = torch.arange(self._packed.num_experts, self._packed.num_experts + m, dtype=idx.dtype)
            idx = torch.cat([idx, ids.expand(t, m)], 1)
            w = torch.cat([w, w.new_ones(t, m) if shared_weight is None else shared_weight.to(w.dtype).expand(t, m)], 1)
        return self._kernel(x, idx, self._packed, extra=extra, weights=w, add=add)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 stacks (gate_up [E, 2I, H], down [E, H, I]) the panels hold."""
        from deepinfer_kernels import moe_gemm

        return moe_gemm.unpack_experts(self._packed)


class NativeGatedMlp(nn.Module):
    """One gated MLP (a shared expert, or a dense layer of an MoE model) as a one-expert stack for
    `moe_gemm.moe_experts`, every row routed to it; callable x [T, H] -> [T, H]. Side by side with
    the oneDNN pair it replaces (silu_mul + down, packed) on this AVX2 EPYC, under load: 1.5-1.8x at
    8-32 rows for V3-shaped 1024 x 256 and 1024 x 2048 MLPs, 1.0-1.2x at 512 rows.

    chunk (a divisor of the intermediate size, a shared expert's routed-expert size): packed instead
    as intermediate / chunk experts of that size (`chunks`), whose outputs summed are the MLP's, so
    NativeExperts.combined can run it in the routed experts' call. One chunk is the plain MLP, the same bits."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, chunk: int | None = None, bf16_dot: bool = False,
                 weights: torch.dtype = torch.float32):
        super().__init__()
        from deepinfer_kernels import moe_gemm

        self._kernel = moe_gemm.moe_experts
        inter = down.shape[1]
        chunk = inter if chunk is None else chunk
        if chunk <= 0 or inter % chunk:
            raise ValueError(f"NativeGatedMlp: chunk {chunk} does not divide the intermediate size {inter}")
        m = inter // chunk
        g, u = gate_up[:inter].view(m, chunk, -1), gate_up[inter:].view(m, chunk, -1)
        gu, dn = torch.cat([g, u], 1).contiguous(), down.view(down.shape[0], m, chunk).transpose(0, 1).contiguous()
        p = moe_gemm.pack_experts_bf16_dot(gu, dn) if bf16_dot else moe_gemm.pack_experts(gu, dn, weights=weights)
        self.register_buffer("packed_gate_up", p.gate_up, persistent=False)
        self.register_buffer("packed_down", p.down, persistent=False)
        self._packed = p
        self.chunks = p
        self._ids = torch.arange(m).unsqueeze(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, m = x.shape[0], self._packed.num_experts
        if m == 1:
            return self._kernel(x, torch.zeros(t, 1, dtype=torch.long), self._packed).view(t, -1)
        return self._kernel(x, self._ids.expand(t, m), self._packed, weights=x.new_ones(t, m))


class _GroupedExperts(nn.Module):
    """One MoE block's stacked experts through a grouped `moe_experts(x, idx, gate_up, down)`; callable
    (x, local ids) -> [T, k, H]."""

    def __init__(self, kernel, gate_up, down):
        super().__init__()
        self._kernel = kernel
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, idx, self.gate_up, self.down)

    def repacked(self, block):
        raise TypeError(f"{type(self).__name__} cannot be rebuilt over swapped experts")


class TileLangExperts(_GroupedExperts):
    """One MoE block's experts for `grouped_gemm.moe_experts` on CUDA (the block's parameters are views
    of the stacks)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        from deepinfer_kernels import grouped_gemm

        super().__init__(grouped_gemm.moe_experts, gate_up, down)
        # compile both GEMMs now, never on the step path
        grouped_gemm.warmup(gate_up, down)

    def repacked(self, block) -> "TileLangExperts":
        """This kernel over the experts `block` holds now (after MoeBlock.swap_experts)."""
        return TileLangExperts(*_stack_in_place(block))


class Fp8TileLangExperts(_GroupedExperts):
    """One MoE block's block-FP8 experts (kept as stored: engine/fp8_linear.py) for `fp8_gemm.moe_experts`,
    the grouped W8A16 kernel, over fp8_gemm.ExpertStacks (the fp8 linear's entries are views of them).
    CUDA with bf16 / fp16 activations, or the kernel's CPU twin at fp32 (kernels="tilelang")."""

    def __init__(self, gate_up, down, dtype: torch.dtype):
        from deepinfer_kernels import fp8_gemm

        super().__init__(fp8_gemm.moe_experts, gate_up, down)
        self._check(dtype)  # (compiles both GEMMs now, never on the step path)

    def _check(self, dtype: torch.dtype) -> None:
        """Four random tokens through the kernel (compiling its two GEMMs) against the torch definition
        (each used expert's weights dequantised, grouped_gemm's reference); raises RuntimeError on a
        wrong result."""
        from deepinfer.engine.fp8_linear import check_result
        from deepinfer_kernels import fp8_gemm, grouped_gemm

        dev, e = self.gate_up.codes.device, self.gate_up.shape[0]
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4, self.gate_up.shape[2], generator=g).to(dev, dtype)
        idx = torch.stack([torch.randperm(e, generator=g)[: min(2, e)] for _ in range(4)]).to(dev)
        used = sorted(set(idx.flatten().tolist()))
        remap = torch.full((e,), -1, dtype=torch.long)
        remap[used] = torch.arange(len(used))
        deq = [torch.stack([fp8_gemm.dequantize(s.codes[i], s.scale[i], s.block_k, dtype) for i in used])
               for s in (self.gate_up, self.down)]
        want = grouped_gemm.moe_experts(x, remap.to(dev)[idx], *deq, gemm=grouped_gemm.grouped_gemm_reference)
        check_result(self(x, idx), want, "the grouped FP8 expert kernel")


def _stack_fp8(block, table: dict):
    """The block's FP8 experts stacked as fp8_gemm.ExpertStacks (gate_up, down), with the fp8 linear's
    per-expert entries re-pointed at their slices (no second copy), or None when its experts are not
    all kept as FP8 with one column block."""
    from deepinfer.engine.loader.fp8_blocks import Fp8Weight
    from deepinfer_kernels.fp8_gemm import ExpertStack

    stacks = []
    for params in (block.expert_gate_up, block.expert_down):
        ws = [table.get(p.data_ptr()) for p in params]
        if not ws or any(w is None for w in ws) or len({w.block_k for w in ws}) != 1:
            return None
        codes, scale = torch.stack([w.codes for w in ws]), torch.stack([w.scale for w in ws])
        for i, p in enumerate(params):
            table[p.data_ptr()] = Fp8Weight(codes[i], scale[i], ws[0].block_k)
        stacks.append(ExpertStack(codes, scale, ws[0].block_k))
    return tuple(stacks)


def install_fp8_experts(model: nn.Module, device: torch.device, dtype: torch.dtype, kernels: str = "auto") -> int:
    """Install the grouped block-FP8 expert kernel in every MoeBlock whose experts the model kept as FP8
    (`model.fp8_weights`); returns how many blocks use it (0: their experts run one at a time through the
    fp8 linear). Runs where the FP8 kernel does (fp8_linear.kernel_runs: CUDA, bf16 / fp16, TileLang),
    and on CPU fp32 with kernels="tilelang" (the CPU twin: tests). Each block's kernel is checked against
    the torch definition at install; a failed compile or check keeps the per-expert path with a warning
    under "auto" and raises under "tilelang"."""
    from deepinfer.engine.fp8_linear import kernel_runs
    from deepinfer.engine.models.moe import MoeBlock

    table = getattr(model, "fp8_weights", {})
    if not table or not kernel_runs(device, dtype, kernels, cpu_twin=True):
        return 0

    def make(b):
        stacks = _stack_fp8(b, table)
        return Fp8TileLangExperts(*stacks, dtype) if stacks is not None else None

    blocks = [m for m in model.modules() if isinstance(m, MoeBlock) and len(m.expert_gate_up)]
    return _install(blocks, make, kernels, "grouped FP8 expert GEMM", "run one at a time through the FP8 linear")


def _install(blocks: list, make, kernels: str, what: str, instead: str) -> int:
    """Install make(block) (None: leave that block) in every block; returns how many took one. A failure
    (a compile, an install check) raises under kernels="tilelang"; otherwise every block keeps its
    per-expert path, with a warning naming `what` failed and what its experts do `instead`."""
    n = 0
    try:
        for b in blocks:
            kernel = make(b)
            if kernel is not None:
                b.set_expert_kernel(kernel)
                n += 1
    except Exception as e:  # noqa: BLE001 - a failure means "keep the per-expert path"
        if kernels == "tilelang":
            raise
        for b in blocks:
            b.set_expert_kernel(None)
        warnings.warn(f"the TileLang {what} is unavailable ({type(e).__name__}: {e}); MoE experts {instead}",
                      RuntimeWarning, stacklevel=3)
        return 0
    return n


def _stack_in_place(block) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the block's expert weights and re-point each expert's parameter at its slice."""
    gu, down = block.stacked_expert_weights()
    for i in range(len(block.expert_gate_up)):
        block.expert_gate_up[i].data = gu[i]
        block.expert_down[i].data = down[i]
    return gu, down


def install_expert_kernels(model: nn.Module, device: torch.device, dtype: torch.dtype, kernels: str = "auto",
                           cpu_prepack: bool = True, expert_weights: torch.dtype = torch.float32,
                           bf16_dot: bool = False) -> int:
    """Install the grouped expert kernel for this device in every MoeBlock of model; returns how many
    blocks use it (0: they keep the per-expert GEMMs). On CPU only for fp32 with kernels="auto" and
    packing allowed (cpu_prepack, EngineConfig's switch for packed weight copies); expert_weights:
    the routed experts' packed storage there (EngineConfig.moe_expert_dtype); bf16_dot: every gated
    MLP as bf16 dot products instead (Engine(dtype="bfloat16"))."""
    if device.type == "cpu":
        ok = dtype == torch.float32 and kernels == "auto" and cpu_prepack
        return install_native_experts(model, expert_weights, bf16_dot=bf16_dot) if ok else 0
    if device.type != "cuda" or kernels == "torch":
        return 0
    from deepinfer.engine.models.moe import MoeBlock
    from deepinfer_kernels import _tilelang

    blocks = [m for m in model.modules() if isinstance(m, MoeBlock) and len(m.expert_gate_up)]
    if not blocks:
        return 0
    if not _tilelang.available():
        if kernels == "tilelang":
            raise RuntimeError(f"kernels='tilelang': TileLang is not importable ({_tilelang.import_error()})")
        return 0
    if dtype == torch.float32:
        if kernels != "tilelang":
            return 0  # TF32 products (module docstring): the fp32 per-expert GEMMs stay
        warnings.warn("kernels='tilelang' on an fp32 MoE model: the grouped expert GEMM multiplies as TF32 on the "
                      "tensor cores (logprobs ~1e-3 from fp32); kernels='auto' keeps fp32 GEMMs", RuntimeWarning,
                      stacklevel=2)
    return _install(blocks, lambda b: TileLangExperts(*_stack_in_place(b)), kernels, "grouped expert GEMM",
                    "run as per-expert GEMMs")


def native_experts_available() -> bool:
    from deepinfer_kernels import moe_gemm

    return moe_gemm.available()


def install_native_experts(model: nn.Module, weights: torch.dtype = torch.float32, bf16_dot: bool = False) -> int:
    """Pack and install the native expert kernel in every MoeBlock of model (fp32 CPU weights, packed
    as `weights`: float32 or bfloat16); returns how many blocks now use it (0 where the native kernels
    do not build). The model's other gated MLPs (shared experts, dense layers) run on the same kernel
    as one-expert stacks, in fp32. bf16_dot: all of them (routed, shared, dense) as bf16 dot products
    (moe_gemm.pack_experts_bf16_dot)."""
    from deepinfer.engine.models.layers import GatedMLP
    from deepinfer.engine.models.moe import MoeBlock
    from deepinfer.engine.placeholder import placeholder
    from deepinfer.engine.cpu_linear import as_stored_bf16
    from deepinfer_kernels import moe_route

    blocks = [m for m in model.modules() if isinstance(m, MoeBlock)]
    if not blocks or not native_experts_available():
        return 0
    n = 0
    for b in blocks:
        if not len(b.expert_gate_up) or b.expert_gate_up[0].dtype != torch.float32 or b.expert_gate_up[0].device.type != "cpu":
            continue
        gu, down = b.stacked_expert_weights()
        b.set_expert_kernel(NativeExperts(gu, down, weights, bf16_dot=bf16_dot))
        b.route_kernel = moe_route.route  # the router's logits -> experts and weights, natively too
        del gu, down
        b.release_expert_weights()  # the packed panels are the experts' only copy from here on
        n += 1
    if n:
        # a shared expert whose intermediate size is a multiple of its block's routed experts' is packed
        # as chunks of their size: the block's combined call then runs it (NativeExperts.can_fuse)
        chunk = {id(b.shared): b.inter for b in blocks if b.shared is not None and b.shared.inter % b.inter == 0}
        for m in model.modules():
            if isinstance(m, GatedMLP) and m.gate_up_weight.dtype == torch.float32 and m.gate_up_weight.device.type == "cpu":
                gu, dn = m.gate_up_weight.data, m.down_weight.data
                # with the routed experts in bf16, a shared expert / dense MLP whose values are all bf16 (a bf16
                # checkpoint's) is packed so too: the same bits, half the bytes (and it still fuses: can_fuse)
                w16 = weights == torch.bfloat16 and all(as_stored_bf16(t) is not None for t in (gu, dn))
                m.kernel = NativeGatedMlp(gu, dn, chunk=chunk.get(id(m)), bf16_dot=bf16_dot,
                                          weights=torch.bfloat16 if w16 else torch.float32)
                # the kernel's panels are its one copy from here on (GatedMLP.forward runs only the kernel)
                m.gate_up_weight.data = placeholder(tuple(gu.shape))
                m.down_weight.data = placeholder(tuple(dn.shape))
    return n
