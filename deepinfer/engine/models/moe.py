"""The mixture-of-experts MLP block: a router picks top-k experts per token, the experts run as a
grouped GEMM, and their outputs are combined in top-k slot order (plus an optional shared expert).

Routing (engine/moe_config.MoeConfig):
* softmax (Qwen2/Qwen3-MoE, DeepSeek-V2): probs = softmax(x @ gate.T), the top-k (V2: optionally
  within the topk_group groups with the best single expert), optionally renormalised, times
  routed_scaling_factor (V2);
* sigmoid (DeepSeek-V3): scores = sigmoid(x @ gate.T) in fp32; experts are *chosen* on scores +
  e_score_correction_bias, within the topk_group best of n_group groups (a group scores the sum of
  its two best), and *weighted* by the plain scores, renormalised, times routed_scaling_factor.

Experts: on CPU fp32 with the native kernels (engine/expert_kernels.py installs it at load) the
routing is one native call (deepinfer_kernels.moe_route) and all routed experts, the slot combine
and the shared expert (as extra groups, when its width is a multiple of the routed experts') run in
one native grouped-GEMM call (deepinfer_kernels.moe_gemm: counting sort by expert, gate/up with silu
* mul in registers, down written to each pair's row, then each token's slots summed in slot order,
bit for bit the torch combine below); on CUDA in two
TileLang grouped GEMMs (deepinfer_kernels.grouped_gemm); elsewhere the
(token, slot) pairs are sorted by expert (a stable sort, so token order is kept inside an expert)
and each active expert runs one GEMM over its rows through ForwardContext.linear / silu_mul. A
token's expert output is one row of that GEMM; with a row-invariant GEMM (the native kernel always,
the batch-invariant mode's linear) it does not depend on which other tokens share the expert, and
the slot-order sum below is elementwise, so `batch_invariant=True` holds with MoE.

A block may hold a subset of the experts (`local_experts`, global ids; default all): its weights
are those experts' only, and `grouped_experts` takes global ids.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.attention import ForwardContext
from deepinfer.engine.moe_config import MoeConfig, MoeConfigError
from deepinfer.engine.placeholder import cat_rows
from deepinfer_kernels import moe_route


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
    def __init__(self, hidden_size: int, moe: MoeConfig, shared_name: str = "shared_expert",
                 local_experts: list[int] | None = None):
        super().__init__()
        from deepinfer.engine.models.layers import GatedMLP

        E, inter = moe.num_experts, moe.expert_intermediate_size
        self.moe = moe
        self.hidden = hidden_size
        self.inter = inter
        # the global ids of the experts this block holds, in the order of its weight lists
        self._set_local_experts(list(range(E)) if local_experts is None else list(local_experts))
        self.expert_kernel = None  # fn(x [T, H], local ids [T, k]) -> [T, k, H], installed at load (expert_kernels.py)
        self._weights_in_kernel = False  # the expert parameters were emptied: the kernel's packed copy is the only one
        # fn(logits, top_k, scoring, bias, n_group, topk_group, group_score, norm, scale) -> (w, ids) for
        # fp32 logits (deepinfer_kernels.moe_route.route, installed with the native experts); None: torch
        self.route_kernel = None
        # the router stays fp32 whatever the model dtype (DeepSeek-V3 routes in fp32; on CPU all is fp32)
        self.gate_weight = nn.Parameter(torch.empty(E, hidden_size), requires_grad=False)
        self.score_bias = nn.Parameter(torch.zeros(E), requires_grad=False) if moe.correction_bias else None
        self.expert_gate_up = nn.ParameterList(
            nn.Parameter(torch.empty(2 * inter, hidden_size), requires_grad=False) for _ in self.local_experts)
        self.expert_down = nn.ParameterList(
            nn.Parameter(torch.empty(hidden_size, inter), requires_grad=False) for _ in self.local_experts)
        self.shared_name = shared_name
        self.shared = None
        if moe.shared_intermediate_size:
            self.shared = GatedMLP(SimpleNamespace(hidden_size=hidden_size, intermediate_size=moe.shared_intermediate_size))
        self.shared_gate_weight = (
            nn.Parameter(torch.empty(1, hidden_size), requires_grad=False) if moe.shared_expert_gate else None)
        # expert parallelism (deepinfer/distributed): the object that runs the expert step across
        # processes; None runs grouped_experts here over the experts this block holds
        self.dispatcher = None

    def _set_local_experts(self, ids: list[int]) -> None:
        E = self.moe.num_experts
        self.local_experts = ids
        self._global_to_local = None  # [E] int64 (-1: not held), only for a subset
        if ids != list(range(E)):
            if len(set(ids)) != len(ids) or not all(0 <= e < E for e in ids):
                raise MoeConfigError(f"local_experts must be distinct expert ids in [0, {E}), got {ids}")
            self._global_to_local = torch.full((E,), -1, dtype=torch.long)
            self._global_to_local[ids] = torch.arange(len(ids))

    def hold_experts(self, expert_ids) -> None:
        """Keep only the experts expert_ids (global ids, a subset of those held now; before load: the
        others are never loaded or packed). Expert parallelism: a rank's shard."""
        held = {e: i for i, e in enumerate(self.local_experts)}
        missing = [e for e in expert_ids if e not in held]
        if missing:
            raise MoeConfigError(f"hold_experts: experts {missing} are not held by this block")
        self.expert_gate_up = nn.ParameterList(self.expert_gate_up[held[e]] for e in expert_ids)
        self.expert_down = nn.ParameterList(self.expert_down[held[e]] for e in expert_ids)
        self._set_local_experts(list(expert_ids))

    def swap_experts(self, expert_ids, fetch) -> None:
        """Hold exactly expert_ids (distinct global ids), after load: experts held now keep their
        weights, the others come from fetch(e) -> (gate_up [2I, H], down [H, I]); the expert kernel is
        then repacked. Expert parallelism: moving redundant copies (distributed/eplb.py). Needs an
        expert kernel on CPU (the per-expert path's weights are packed by the linear, keyed by address)."""
        ref = self.expert_gate_up[0] if len(self.expert_gate_up) else self.gate_weight
        if self.expert_kernel is None and ref.device.type == "cpu":
            raise MoeConfigError("swap_experts needs the grouped expert kernel on CPU (kernels='auto', cpu_prepack=True)")
        held = {e: i for i, e in enumerate(self.local_experts)}
        gu_held, dn_held = self.stacked_expert_weights() if held else (None, None)
        gate_up, down = [], []
        for e in expert_ids:
            if e in held:
                gu, dn = gu_held[held[e]], dn_held[held[e]]
            else:
                gu, dn = fetch(e)
                if tuple(gu.shape) != (2 * self.inter, self.hidden) or tuple(dn.shape) != (self.hidden, self.inter):
                    raise MoeConfigError(f"swap_experts: expert {e} weights have shapes {tuple(gu.shape)}, {tuple(dn.shape)}")
            gate_up.append(nn.Parameter(gu.to(ref.device, ref.dtype).contiguous(), requires_grad=False))
            down.append(nn.Parameter(dn.to(ref.device, ref.dtype).contiguous(), requires_grad=False))
        released = self._weights_in_kernel
        self._set_local_experts(list(expert_ids))
        self.expert_gate_up = nn.ParameterList(gate_up)
        self.expert_down = nn.ParameterList(down)
        self._weights_in_kernel = False
        if self.expert_kernel is not None:
            self.expert_kernel = self.expert_kernel.repacked(self)
            if released:
                self.release_expert_weights()

    # ---- routing --------------------------------------------------------------------------------
    def route(self, x: torch.Tensor, meta: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k] int64), slots ordered by descending choice score."""
        m = self.moe
        if x.dtype == torch.float32:
            logits = meta.linear(x, self.gate_weight, None)  # packed (and row-invariant) on CPU
        else:
            logits = F.linear(x.float(), self.gate_weight)
        route = moe_route.route_reference
        kw = {"sigmoid": _sigmoid_rows}
        if self.route_kernel is not None and logits.dtype == torch.float32 and logits.device.type == "cpu":
            route, kw = self.route_kernel, {}
        return route(logits.float(), m.top_k, m.scoring, self.score_bias, m.n_group, m.topk_group, m.group_score,
                     m.norm_topk_prob, m.routed_scaling_factor, **kw)

    # ---- experts --------------------------------------------------------------------------------
    def _expert(self, x: torch.Tensor, e: int, meta: ForwardContext) -> torch.Tensor:
        gu = self.expert_gate_up[e]
        if meta.silu_mul is not None:
            h = meta.silu_mul(x, gu)
        else:
            g, u = meta.linear(x, gu, None).split([self.inter, self.inter], dim=-1)
            h = F.silu(g) * u
        return meta.linear(h, self.expert_down[e], None)

    def to_local(self, idx: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> positions in this block's weight lists (identity when it holds all)."""
        if self._global_to_local is None:
            return idx
        lut = self._global_to_local.to(idx.device)
        local = lut[idx]
        if bool((local < 0).any()):
            missing = sorted(set(idx[local < 0].tolist()))
            raise MoeConfigError(f"tokens routed to experts {missing}, which this block does not hold "
                                 f"(it holds {self.local_experts})")
        return local

    def set_expert_kernel(self, kernel) -> None:
        """Run the routed experts through kernel(x, local ids) -> [T, k, H] (None: per-expert GEMMs,
        on the parameters, which get the kernel's weights back if they were emptied)."""
        if kernel is None and self._weights_in_kernel:
            self._restore_expert_weights()
        self.expert_kernel = kernel

    def release_expert_weights(self) -> None:
        """Empty the expert parameters: the installed kernel's packed copy (it must `unpacked()`) is then
        the only one in memory. A MoE model's routed experts are most of its bytes; kept twice (the
        parameters and the packed panels) they held 2.15x a tiny Qwen3-MoE checkpoint's bytes, 1.1x once
        released (engine stats weight_bytes / checkpoint_bytes)."""
        if self.expert_kernel is None or not hasattr(self.expert_kernel, "unpacked"):
            raise MoeConfigError("release_expert_weights needs an installed expert kernel that can unpack its weights")
        for w in list(self.expert_gate_up) + list(self.expert_down):
            w.data = w.data.new_empty(0)
        self._weights_in_kernel = True

    def _restore_expert_weights(self) -> None:
        gu, dn = self.expert_kernel.unpacked()
        for i in range(len(self.expert_gate_up)):
            self.expert_gate_up[i].data = gu[i].to(self.gate_weight.dtype)
            self.expert_down[i].data = dn[i].to(self.gate_weight.dtype)
        self._weights_in_kernel = False

    def stacked_expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [E_local, 2I, H], down [E_local, H, I]): copies of the experts' weights, stacked
        (from the kernel's packed copy when the parameters were released)."""
        if self._weights_in_kernel:
            return self.expert_kernel.unpacked()
        return torch.stack([w.data for w in self.expert_gate_up]), torch.stack([w.data for w in self.expert_down])

    def grouped_experts(self, x: torch.Tensor, idx: torch.Tensor, meta: ForwardContext) -> torch.Tensor:
        """[T, k, H]: the output of expert idx[t, j] (a global id) on token t, one GEMM per active expert."""
        idx = self.to_local(idx)
        if self.expert_kernel is not None:
            return self.expert_kernel(x, idx)
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.local_experts)).tolist()
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

    def _shared_out(self, x: torch.Tensor, meta: ForwardContext) -> torch.Tensor:
        s = self.shared(x, meta)
        if self.shared_gate_weight is not None:
            s = self._shared_gate(x, meta) * s
        return s

    def _shared_gate(self, x: torch.Tensor, meta: ForwardContext) -> torch.Tensor:
        """sigmoid(x . shared_expert_gate) [T, 1] (Qwen2-MoE): on CPU fp32 moe_route.c's sigmoid, the one
        the decode stack computes, so the fused, added and stacked forms share its bits; torch's elsewhere."""
        g = meta.linear(x, self.shared_gate_weight, None)
        if g.device.type == "cpu" and g.dtype == torch.float32 and moe_route.available():
            return moe_route.sigmoid(g)
        return torch.sigmoid(g)

    def forward(self, x: torch.Tensor, meta: ForwardContext) -> torch.Tensor:
        w, idx = self.route(x, meta)
        kernel = self.expert_kernel
        if self.dispatcher is None and hasattr(kernel, "combined"):
            # experts, slot combine and (fused, or added) shared expert in one native call: the same
            # bits as the path below (products rounded, then summed in slot order, + shared)
            idx = self.to_local(idx)
            if self.shared is not None and kernel.can_fuse(self.shared):
                if self.shared_gate_weight is None:
                    return kernel.combined(x, idx, w, shared=self.shared)
                # Qwen2-MoE: the shared chunks' slots weighted by the gate (native_decode binds this form)
                return kernel.combined(x, idx, w, shared=self.shared, shared_weight=self._shared_gate(x, meta))
            add = self._shared_out(x, meta) if self.shared is not None else None
            return kernel.combined(x, idx, w, add=add)
        if self.dispatcher is not None:  # [T, k, H] computed where the experts live
            per_slot = self.dispatcher(self, x, idx, meta)
        else:
            per_slot = self.grouped_experts(x, idx, meta)
        weighted = per_slot * w.to(x.dtype).unsqueeze(-1)  # elementwise: one call, not one per slot
        out = weighted[:, 0]
        for j in range(1, idx.shape[1]):  # a fixed (slot) order: the same sum whatever the batch
            out = out + weighted[:, j]
        if self.shared is not None:
            out = out + self._shared_out(x, meta)
        return out

    # ---- weights --------------------------------------------------------------------------------
    def linear_weights(self) -> list[torch.Tensor]:
        # (the experts' weights only while they go through ForwardContext.linear, not the expert kernel)
        ws = [self.gate_weight.data]
        ws += [w.data for w in self.expert_down] if self.expert_kernel is None else []
        if self.shared is not None:
            ws += self.shared.linear_weights()
        if self.shared_gate_weight is not None:
            ws.append(self.shared_gate_weight.data)
        return ws

    def gated_weights(self) -> list[torch.Tensor]:
        ws = [w.data for w in self.expert_gate_up] if self.expert_kernel is None else []
        return ws + (self.shared.gated_weights() if self.shared is not None else [])

    def load(self, prefix: str, take, put) -> None:
        """prefix: 'model.layers.{i}.mlp.'; checkpoint names as save_pretrained writes them."""
        put(self.gate_weight, take(prefix + "gate.weight"), prefix + "gate.weight", dtype=torch.float32)
        if self.score_bias is not None:
            n = prefix + "gate.e_score_correction_bias"
            put(self.score_bias, take(n), n, dtype=torch.float32)
        for i, e in enumerate(self.local_experts):
            p = f"{prefix}experts.{e}."
            gu = cat_rows([take(p + "gate_proj.weight"), take(p + "up_proj.weight")], p + "gate_up_proj.weight")
            put(self.expert_gate_up[i], gu, p + "gate_up_proj.weight")
            put(self.expert_down[i], take(p + "down_proj.weight"), p + "down_proj.weight")
        if self.shared is not None:
            self.shared.load(f"{prefix}{self.shared_name}.", take, put)
        if self.shared_gate_weight is not None:
            n = prefix + "shared_expert_gate.weight"
            put(self.shared_gate_weight, take(n), n)
