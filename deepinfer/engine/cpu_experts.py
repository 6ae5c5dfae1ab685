"""The routed experts of every MoE block on the native grouped GEMM (deepinfer_kernels.moe_gemm), CPU fp32.

`install_native_experts(model)` packs each MoeBlock's experts once at load (stacked, in the kernel's
panels) and makes the block run them in one native call per layer. Installed before the runner
builds its CpuLinear, so the experts' weights are packed once, here, and not also for the linear.

Why (benchmarks/moe.py and this change's micro-benchmark, DeepSeek-V3-shaped layer: 32 experts of
1024 x 256, top-4, 2-core AVX2 EPYC, under load): the per-expert torch path (argsort, index_select,
a oneDNN gate/up and down call per active expert, index_copy) measured 4x slower than one native call
at 1 token and 8-24x at 8-32 tokens; its time went to per-call overhead on 1-16-row GEMMs.
"""

from __future__ import annotations

import torch
from torch import nn


class NativeExperts(nn.Module):
    """One MoE block's experts packed for `moe_gemm.moe_experts`; callable (x, local ids) -> [T, k, H].
    The packed panels are non-persistent buffers, so the runner's weight_bytes counts them."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        from deepinfer_kernels import moe_gemm

        self._kernel = moe_gemm.moe_experts
        p = moe_gemm.pack_experts(gate_up, down)
        self.register_buffer("packed_gate_up", p.gate_up, persistent=False)
        self.register_buffer("packed_down", p.down, persistent=False)
        self._packed = p

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return self._kernel(x, idx, self._packed)


def native_experts_available() -> bool:
    from deepinfer_kernels import moe_gemm

    return moe_gemm.available()


def install_native_experts(model: nn.Module) -> int:
    """Pack and install the native expert kernel in every MoeBlock of model (fp32 CPU weights);
    returns how many blocks now use it (0 where the native kernels do not build)."""
    from deepinfer.engine.models.moe import MoeBlock

    blocks = [m for m in model.modules() if isinstance(m, MoeBlock)]
    if not blocks or not native_experts_available():
        return 0
    n = 0
    for b in blocks:
        if not len(b.expert_gate_up) or b.expert_gate_up[0].dtype != torch.float32 or b.expert_gate_up[0].device.type != "cpu":
            continue
        gu, down = b.stacked_expert_weights()
        b.set_expert_kernel(NativeExperts(gu, down))
        n += 1
    return n
