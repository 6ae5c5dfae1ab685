"""The mixture-of-experts MLP block: a router picks top-k experts per token, the experts run as a
grouped GEMM, and their outputs are combined in top-k slot order (plus an optional shared expert).

Routing (engine/moe_config.MoeConfig):
* softmax (Qwen2/Qwen3-MoE, DeepSeek-V2): probs = softmax(x @ gate.T), the top-k (V2: optionally
  within the topk_group groups with the best single expert), optionally renormalised, times
  routed_scaling_factor (V2);
* sigmoid (DeepSeek-V3): scores = sigmoid(x @ gate.T) in fp32; experts are *chosen* on scores +
  e_score_correction_bias, within the topk_group best of n_group groups (a group scores the sum of
  its two best), and *weighted* by the plain scores, renormalised, times routed_scaling_factor.

Experts: the (token, slot) pairs are sorted by expert (a stable sort, so token order is kept inside
an expert) and each active expert runs one GEMM over its rows through ForwardContext.linear /
silu_mul, i.e. on the weights CpuLinear packed once at load. A token's expert output is one row of
that GEMM; with a row-invariant GEMM (the batch-invariant mode's) it does not depend on which other
tokens share the expert, and the slot-order sum below is elementwise, so `batch_invariant=True`
holds with MoE.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.attention import ForwardContext
from deepinfer.engine.moe_config import MoeConfig


def _sigmoid_rows(z: torch.Tensor, width: int = 64, rows: int = 256) -> torch.Tensor:
    """torch.sigmoid whose bits for a row do not depend on the row's place in the batch.

    torch's elementwise CPU loop runs 2 vectors at a time and the flat tensor's last < 2 vectors
    through a scalar path with other rounding, so plain sigmoid([T, E]) gave the last row of a
    9-row batch other bits than the same row inside an 18-row batch (found by the expert-parallel
    bitwise test, where ranks route halves of the batch). Rows padded to a multiple of 64 floats
    (whole 2-vector steps on AVX2 (16 floats) and AVX-512 (32)), in blocks of 256 rows (16K floats:
    under torch's parallel grain, so one thread runs each block from its start), never reach it."""
    T, E = z.shape
    out = torch.empty_like(z)
    for s in range(0, T, rows):
        blk = z.new_zeros(min(rows, T - s), -(-E // width) * width)
        blk[:, :E] = z[s : s + rows]
        out[s : s + rows] = torch.sigmoid(blk)[:, :E]
    return out


class MoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeConfig, shared_name: str = "shared_expert"):
        super().__init__()
        from deepinfer.engine.models.layers import GatedMLP

        E, inter = moe.num_experts, moe.expert_intermediate_size
        self.moe = moe
        self.hidden = hidden_size
        self.inter = inter
        # the router stays fp32 whatever the model dtype (DeepSeek-V3 routes in fp32; on CPU all is fp32)
        self.gate_weight = nn.Parameter(torch.empty(E, hidden_size), requires_grad=False)
        self.score_bias = nn.Parameter(torch.zeros(E), requires_grad=False) if moe.correction_bias else None
        self.expert_gate_up = nn.ParameterList(
            nn.Parameter(torch.empty(2 * inter, hidden_size), requires_grad=False) for _ in range(E))
        self.expert_down = nn.ParameterList(
            nn.Parameter(torch.empty(hidden_size, inter), requires_grad=False) for _ in range(E))
        self.shared_name = shared_name
        self.shared = None
        if moe.shared_intermediate_size:
            self.shared = GatedMLP(SimpleNamespace(hidden_size=hidden_size, intermediate_size=moe.shared_intermediate_size))
        self.shared_gate_weight = (
            nn.Parameter(torch.empty(1, hidden_size), requires_grad=False) if moe.shared_expert_gate else None)
        # expert parallelism (deepinfer/distributed): the global ids of the experts this block holds
        # (expert_gate_up[i] is expert expert_ids[i]), and the object that runs the expert step
        # across processes; None runs grouped_experts here over every expert
        self.expert_ids = range(E)
        self.dispatcher = None

    def hold_experts(self, expert_ids: range) -> None:
        """Keep only the experts expert_ids (before load: the others are never loaded or packed)."""
        self.expert_ids = expert_ids
        self.expert_gate_up = nn.ParameterList(self.expert_gate_up[e] for e in expert_ids)
        self.expert_down = nn.ParameterList(self.expert_down[e] for e in expert_ids)

    # ---- routing --------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, meta: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k] int64), slots ordered by descending choice score."""
        m = self.moe
        if x.dtype == torch.float32:
            logits = meta.linear(x, self.gate_weight, None)  # packed (and row-invariant) on CPU
        else:
            logits = F.linear(x.float(), self.gate_weight)
        scores = torch.softmax(logits.float(), dim=-1) if m.scoring == "softmax" else _sigmoid_rows(logits.float())
        choice = scores + self.score_bias if self.score_bias is not None else scores
        if m.n_group > 1:
            T = choice.shape[0]
            grouped = choice.view(T, m.n_group, -1)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1) if m.group_score == "top2_sum" else grouped.amax(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, torch.topk(group_scores, m.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(m.num_experts // m.n_group, dim=1), float("-inf"))
        idx = torch.topk(choice, m.top_k, dim=-1).indices
        w = scores.gather(1, idx)
        if m.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if m.scoring == "sigmoid" else 0.0))
        if m.routed_scaling_factor == 1.0:
            return w, idx
        return w * m.routed_scaling_factor, idx

    # ---- experts --------------------------------------------------------------------------------
    def _expert(self, x: torch.Tensor, e: int, meta: ForwardContext) -> torch.Tensor:
        gu = self.expert_gate_up[e]
        if meta.silu_mul is not None:
            h = meta.silu_mul(x, gu)
        else:
            g, u = meta.linear(x, gu, None).split([self.inter, self.inter], dim=-1)
            h = F.silu(g) * u
        return meta.linear(h, self.expert_down[e], None)

    def grouped_experts(self, x: torch.Tensor, idx: torch.Tensor, meta: ForwardContext) -> torch.Tensor:
        """[T, k, H]: the output of expert idx[t, j] on token t, one GEMM per active expert."""
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        xs = x.index_select(0, order // k)
        ys = torch.empty(T * k, self.hidden, dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self._expert(xs[start : start + n], e, meta)
                start += n
        out = torch.empty_like(ys)
        out.index_copy_(0, order, ys)
        return out.view(T, k, self.hidden)

    def forward(self, x: torch.Tensor, meta: ForwardContext) -> torch.Tensor:
        w, idx = self.route(x, meta)
        if self.dispatcher is not None:  # [T, k, H] computed where the experts live
            per_slot = self.dispatcher(self, x, idx, meta)
        else:
            per_slot = self.grouped_experts(x, idx, meta)
        w = w.to(x.dtype)
        out = per_slot[:, 0] * w[:, :1]
        for j in range(1, idx.shape[1]):  # a fixed (slot) order: the same sum whatever the batch
            out = out + per_slot[:, j] * w[:, j : j + 1]
        if self.shared is not None:
            s = self.shared(x, meta)
            if self.shared_gate_weight is not None:
                s = torch.sigmoid(meta.linear(x, self.shared_gate_weight, None)) * s
            out = out + s
        return out

    # ---- weights --------------------------------------------------------------------------------
    def linear_weights(self) -> list[torch.Tensor]:
        ws = [self.gate_weight.data] + [w.data for w in self.expert_down]
        if self.shared is not None:
            ws += self.shared.linear_weights()
        if self.shared_gate_weight is not None:
            ws.append(self.shared_gate_weight.data)
        return ws

    def gated_weights(self) -> list[torch.Tensor]:
        ws = [w.data for w in self.expert_gate_up]
        return ws + (self.shared.gated_weights() if self.shared is not None else [])

    def load(self, prefix: str, take, put) -> None:
        """prefix: 'model.layers.{i}.mlp.'; checkpoint names as save_pretrained writes them."""
        put(self.gate_weight, take(prefix + "gate.weight"), prefix + "gate.weight", dtype=torch.float32)
        if self.score_bias is not None:
            n = prefix + "gate.e_score_correction_bias"
            put(self.score_bias, take(n), n, dtype=torch.float32)
        for i, e in enumerate(self.expert_ids):
            p = f"{prefix}experts.{e}."
            gu = torch.cat([take(p + "gate_proj.weight"), take(p + "up_proj.weight")], 0)
            put(self.expert_gate_up[i], gu, p + "gate_up_proj.weight")
            put(self.expert_down[i], take(p + "down_proj.weight"), p + "down_proj.weight")
        if self.shared is not None:
            self.shared.load(f"{prefix}{self.shared_name}.", take, put)
        if self.shared_gate_weight is not None:
            n = prefix + "shared_expert_gate.weight"
            put(self.shared_gate_weight, take(n), n)
