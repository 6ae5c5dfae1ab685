"""The CPU fp32 MoE models' remaining projections on the native expert kernel's register tile.

On CPUs without AVX-512 the runner's linear is oneDNN (the shared 8 x 48 panel GEMM spills on 16
ymm registers, see cpu_linear.native_gemm_preferred), while the experts and the models' gated MLPs
run on moe_gemm's 4 x 24 tile (expert_kernels.py). This moves the rest of a DeepSeek-style layer
there too: MLA's q / kv down projections (one GEMM over [q_a; kv_a]: both read the same x), q_b and
o_proj (MlaAttention.set_projection_kernels), a GQA layer's qkv and o projections (Attention.kernels,
Qwen-MoE), and every MoE router (MoeBlock.router_kernel). Each
weight is packed once at load (the runner's linear then skips it). `moe_gemm.linear` gives each
output one multiply-add chain over k in order, so batch invariance holds.

Installed by expert_kernels.install_native_experts, only where the runner's linear would not be the
native panel GEMM already (native_gemm_preferred() False). Side by side (benchmarks/moe_kernels.py,
2-core AVX2 EPYC shared with other jobs, 1 thread, best of 9): at 32 rows (a batch-32 decode step)
1.08-1.35x the best of oneDNN's packed GEMM and F.linear on the V3 MLA and Qwen3 GQA shapes
(router: 0.8x of F.linear, 1.2x of oneDNN); at 1 row 1.1-1.7x the engine's oneDNN path except
Qwen3's qkv (0.8x), below F.linear's GEMV (0.44-0.87x); at 512 rows 0.86-1.13x. With 2 threads
on the loaded machine every kernel's times were dominated by the other jobs (ms per call).
"""

from __future__ import annotations

import torch
from torch import nn


class NativeLinear(nn.Module):
    """x [M, K] -> x @ W.T on a copy of W packed for moe_gemm.linear (a non-persistent buffer, so the
    runner's weight_bytes counts it)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        from deepinfer_kernels import moe_gemm

        self._kernel = moe_gemm.linear
        self._packed = moe_gemm.pack_linear(w.contiguous())
        self.register_buffer("packed", self._packed.panels, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, self._packed)


def _fp32_cpu(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.device.type == "cpu"


def install_native_projections(model: nn.Module) -> int:
    """Give every MlaAttention, Attention and MoeBlock of model native projection kernels; returns how many
    modules got them (0 where the native GEMM is the runner's linear already, or weights are not
    fp32 CPU)."""
    from deepinfer.engine.cpu_linear import native_gemm_preferred
    from deepinfer.engine.models.layers import Attention
    from deepinfer.engine.models.mla import MlaAttention
    from deepinfer.engine.models.moe import MoeBlock

    if native_gemm_preferred():
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, MlaAttention) and _fp32_cpu(m.o_weight):
            m.set_projection_kernels({name: NativeLinear(w) for name, w in m.projection_weights().items()})
            n += 1
        elif isinstance(m, Attention) and _fp32_cpu(m.o_weight):
            m.kernels = nn.ModuleDict({"qkv": NativeLinear(m.qkv_weight.data), "o": NativeLinear(m.o_weight.data)})
            n += 1
        elif isinstance(m, MoeBlock) and _fp32_cpu(m.gate_weight):
            m.router_kernel = NativeLinear(m.gate_weight.data)
            n += 1
    return n
