"""The native decode stack (csrc/decode_stack.c): every decoder layer of a Llama / Qwen2 / Qwen3 model,
dense or with Qwen-style MoE layers, or of a DeepSeek-V2 / V3 model (latent attention, `StackMla`; MoE
layers with a shared expert), for a batch of few query tokens (up to `max_rows`: decodes, drafts
to verify, short prefill chunks; one row per token, attending to its own position's prefix) in one C
call, on GGUF block weights as stored (`quant.QuantWeight`) or packed panels (`native.PackedWeight`),
fp32 activations and KV cache. An MoE layer (`StackMoe`) is its router's panels, the routing's
arguments and the experts' stacks (`moe_gemm.PackedExperts`), run as MoeBlock runs them.

It calls the kernels the per-op path calls (the panel GEMMs; quant's row kernels in the exact or int8 mode; from 16
rows the int8 mode's outer kernel (the int8 row kernel's bits) or the exact mode's `many` kernel
(panel, outer or bf16: the one QuantLinear picks), the native RMSNorm, rotary + KV store, token
attention, silu * mul) with the same arguments in the same order, so its hidden states are
bit-identical to that path's; it saves the Python between the ops (~10 per layer at ~17 us each
against a few us of work for the small ones at batch 1).

`DecodeStack(...)` binds the weights, the caches and the rotary tables once (their addresses: the
tensors must not be replaced afterwards); a call passes only the step's tensors.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import moe_gemm, moe_route, native, quant
from .errors import KernelInputError

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_W = _i64 * 5


class _Moe(ctypes.Structure):
    _fields_ = [("router", _W), ("score_bias", _ptr), ("gate_up", _ptr), ("down", _ptr)] + [
        (n, _i64) for n in ("experts", "top_k", "inter", "kind", "scoring", "n_group", "topk_group", "group_score",
                            "norm")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("shared", _i64),
                                        ("shared_gate_up", _ptr), ("shared_down", _ptr), ("shared_gate", _W)]


class _Mla(ctypes.Structure):
    _fields_ = [("q_a", _W), ("q_b", _W), ("kv_a", _W), ("q_a_norm", _ptr), ("kv_a_norm", _ptr),
                ("uk", ctypes.POINTER(_W)), ("uv", ctypes.POINTER(_W)), ("interleave", _i64),
                ("q_a_eps", ctypes.c_float), ("kv_a_eps", ctypes.c_float), ("scale", ctypes.c_float)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", _ptr), ("post_norm", _ptr), ("qkv_bias", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("k_cache", _ptr), ("v_cache", _ptr),
                ("qkv", _W), ("o", _W), ("gate_up", _W), ("down", _W), ("moe", ctypes.POINTER(_Moe)),
                ("mla", ctypes.POINTER(_Mla))]


class _Model(ctypes.Structure):
    _fields_ = [(n, _i64) for n in ("n_layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "slots",
                                    "block_size", "positions", "mode", "max_rows", "many", "panel_m",
                                    "outer_rows", "outer_rows_q4", "kv_bf16", "moe_experts", "moe_top_k",
                                    "moe_inter", "mla_r", "mla_rope", "mla_nope", "mla_v", "mla_q_lora")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", _ptr), ("sin", _ptr), ("final_norm", _ptr),
        ("layers", ctypes.POINTER(_Layer)), ("work", _ptr)]


_ERRORS = {1: "rows or layer count out of range", 2: "a position is outside the rotary table or the block table",
           3: "a KV slot is outside the cache", 4: "out of memory", 5: "a projection kernel refused its weight"}
_MODES = {"exact": 0, "int8": 1}
# the exact mode's kernel from quant.PANEL_M rows, as QuantLinear picks it: "panel" (the row kernel's
# bits: qlinear(mode="exact"), the batch-invariant mode), "outer" (qlinear_outer), "bf16" (qlinear_bf16)
_MANY = {"panel": 0, "outer": 1, "bf16": 2}
# csrc/decode_stack.c's codes (DS_PANEL_*, DS_EXPERTS_*) for the kernels native.panel_kernel and
# moe_gemm.experts_kernel pick: the per-op path's choice, made in one place
_PANELS = {"di_gemm_f32": 100, "di_gemm_bf16": 101, "di_gemm_f16": 102, "di_gemm_bf16dot": 103}
_EXPERTS = {"di_moe_experts_f32": 0, "di_moe_experts_bf16": 1, "di_moe_experts_bf16dot": 2}

Projection = quant.QuantWeight | native.PackedWeight


def _configure(lib) -> None:
    lib.di_decode_stack_work_bytes.argtypes = [ctypes.POINTER(_Model)]
    lib.di_decode_stack_work_bytes.restype = _i64
    lib.di_decode_stack.argtypes = [ctypes.POINTER(_Model), _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr]
    lib.di_decode_stack.restype = ctypes.c_int


def _lib():
    return native.require(_configure)


@dataclass(frozen=True)
class StackMoe:
    """An MoE layer (models/moe.py's MoeBlock): the router's panels (E outputs, fp32 logits),
    `moe_route.route`'s arguments, the routed experts packed for `moe_gemm.moe_experts` (slots combined in
    its call, as MoeBlock.forward runs them) and a shared expert's chunks in the same call (`shared`: the
    stacks NativeExperts.combined appends, weighted 1, or with `shared_gate`'s panels (Qwen2-MoE's
    [1, hidden] gate) sigmoid(x . gate)). router None: a dense gated MLP packed as one expert
    (expert_kernels.NativeGatedMlp), every row to it, top_k 1, nothing combined."""

    router: native.PackedWeight | None
    experts: moe_gemm.PackedExperts
    top_k: int
    scoring: str = "softmax"
    score_bias: torch.Tensor | None = None  # [E] fp32, for choosing only
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    norm: bool = False
    scale: float = 1.0
    shared: moe_gemm.PackedExperts | None = None
    shared_gate: native.PackedWeight | None = None


@dataclass(frozen=True)
class StackMla:
    """A latent attention block (models/mla.py's MlaAttention, the absorbed projections one linear a head):
    q_a and q_b panels (q_b None: q_a is the plain q projection, q_a_norm None), kv_a_proj_with_mqa's,
    the q_a / kv_a RMSNorm weights and epsilons, each head's W_uk^T [r, nope] and W_uv [v, r] panels, the
    head sizes, DeepSeek's interleaved rope flag and the softmax scale. The layer's o is its o_proj and
    its k_cache (= v_cache) the latent entries [slots, 1, r + rope]."""

    q_a: native.PackedWeight
    q_b: native.PackedWeight | None
    kv_a: native.PackedWeight
    q_a_norm: torch.Tensor | None
    kv_a_norm: torch.Tensor
    uk: list[native.PackedWeight]
    uv: list[native.PackedWeight]
    nope: int
    rope: int
    v: int
    interleave: bool
    scale: float
    q_a_eps: float = 1e-6
    kv_a_eps: float = 1e-6


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer's tensors: norms [hidden] fp32, projections as blocks or packed panels (q|k|v
    and gate|up fused as row concatenations; gate|up panels packed gated), the q|k|v bias or None, its
    K and V caches [slots, Hkv, D] (fp32, or all bf16). An MoE layer gives `moe` instead of gate_up / down."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection | None  # (None with mla)
    qkv_bias: torch.Tensor | None
    o: Projection
    gate_up: Projection | None
    down: Projection | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_norm: torch.Tensor | None = None  # [D] per-head RMSNorm weights of q and k (Qwen3): both or neither
    k_norm: torch.Tensor | None = None
    moe: StackMoe | None = None
    mla: StackMla | None = None


def _shape(w: Projection) -> tuple[int, int]:
    if isinstance(w, native.PackedWeight):
        return (2 * w.n if w.gated else w.n, w.k)
    return tuple(w.shape)


def _bind_weight(c: ctypes.Array, w: Projection) -> torch.Tensor:
    """Fill a di_ds_weight; returns the tensor whose address it holds."""
    if isinstance(w, native.PackedWeight):
        c[:] = (w.panels.data_ptr(), int(w.gated), _PANELS[native.panel_kernel(w)], w.n, w.k)
        return w.panels
    c[:] = (w.data.data_ptr(), w.data.shape[1], w.fmt, w.n, w.k)
    return w.data


def _dense(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        want = "float32" if dtype == torch.float32 else f"{dtype} (as layer 0's cache)"
        raise KernelInputError(f"DecodeStack: {name} must be a contiguous {want} CPU tensor {shape}, "
                               f"got {t.dtype} {tuple(t.shape)}")


class DecodeStack:
    """hidden = stack(x, positions, slots, block_tables): the decoder layers and the final norm over the
    token embeddings x [M, hidden] of M < max_rows + 1 query rows (see csrc/decode_stack.c).

    many: the exact mode's kernel from quant.PANEL_M rows (see _MANY); int8_outer_rows: the rows
    (Q8_0, Q4_0 / Q4_1) from which the int8 mode runs the vpdpbusd outer kernel (the row kernel's bits,
    so they only pick the faster kernel; the default never does). The caller passes what its per-op
    path uses (native_decode.py: quant_linear's)."""

    def __init__(self, layers: list[StackLayer], final_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float, num_heads: int, block_size: int, mode: str, max_rows: int = quant.PANEL_M - 1,
                 many: str = "panel", int8_outer_rows: tuple[int, int] = (1 << 62, 1 << 62)):
        if mode not in _MODES:
            raise KernelInputError(f"DecodeStack: mode must be one of {tuple(_MODES)}, got {mode!r}")
        if many not in _MANY:
            raise KernelInputError(f"DecodeStack: many must be one of {tuple(_MANY)}, got {many!r}")
        if not layers or max_rows < 1 or block_size < 1:
            raise KernelInputError("DecodeStack: needs at least one layer, max_rows >= 1 and block_size >= 1")
        lib = _lib()
        first = layers[0]
        slots, kv_heads, head_dim = first.k_cache.shape
        if first.k_cache.dtype not in native.KV_DTYPES:
            raise KernelInputError(f"DecodeStack: the KV caches must be float32 or bfloat16, got {first.k_cache.dtype}")
        hidden = first.o.n
        inter = max((ly.down.k for ly in layers if ly.moe is None and ly.down is not None), default=0)
        moes = [ly.moe for ly in layers if ly.moe is not None]
        mla = first.mla
        if any((ly.mla is None) != (mla is None) for ly in layers):
            raise KernelInputError("DecodeStack: latent attention in some layers only")
        entry = head_dim  # a cache slot's values a KV head
        if mla is not None:  # one latent entry a slot; the rotary tables cover the rope part
            kv_heads, head_dim = 1, mla.rope
            if entry <= mla.rope:
                raise KernelInputError(f"DecodeStack: latent entries of {entry} values leave no latent next to rope {mla.rope}")
        if num_heads % kv_heads or head_dim % 2:
            raise KernelInputError(f"DecodeStack: {num_heads} heads do not fit {kv_heads} KV heads of dim {head_dim}")
        qkv_n = (num_heads + 2 * kv_heads) * head_dim
        positions = cos.shape[0]
        _dense("cos", cos, (positions, head_dim))
        _dense("sin", sin, (positions, head_dim))
        _dense("final_norm", final_norm, (hidden,))
        self._keep: list = [cos, sin, final_norm]  # everything whose address is bound
        self._layers = (_Layer * len(layers))()
        for i, ly in enumerate(layers):
            _dense(f"layer {i} in_norm", ly.in_norm, (hidden,))
            _dense(f"layer {i} post_norm", ly.post_norm, (hidden,))
            for name in ("k_cache", "v_cache"):  # all fp32 or all bf16
                _dense(f"layer {i} {name}", getattr(ly, name), (slots, kv_heads, entry), first.k_cache.dtype)
            want = {"qkv": (qkv_n, hidden), "o": (hidden, num_heads * head_dim)}
            if mla is not None:
                want = {"o": (hidden, num_heads * ly.mla.v)}
            if ly.moe is None:
                want.update(gate_up=(2 * inter, hidden), down=(hidden, inter))
            c = self._layers[i]
            for name, shape in want.items():
                w = getattr(ly, name)
                if w is None or _shape(w) != shape:
                    raise KernelInputError(f"DecodeStack: layer {i} {name} is "
                                           f"{None if w is None else _shape(w)}, expected {shape}")
                if isinstance(w, native.PackedWeight) and w.gated != (name == "gate_up"):
                    raise KernelInputError(f"DecodeStack: layer {i} {name}: panels packed {'' if w.gated else 'not '}gated")
                if mode == "int8" and isinstance(w, quant.QuantWeight) and w.k % quant.QK:
                    raise KernelInputError(f"DecodeStack: layer {i} {name}: K = {w.k} is not a multiple of {quant.QK}")
                self._keep.append(_bind_weight(getattr(c, name), w))
            if ly.moe is not None:
                c.moe = ctypes.pointer(self._bind_moe(i, ly.moe, hidden))
            if ly.mla is not None:
                c.mla = ctypes.pointer(self._bind_mla(i, ly.mla, hidden, num_heads, entry, mla))
            if ly.qkv_bias is not None:
                _dense(f"layer {i} qkv_bias", ly.qkv_bias, (qkv_n,))
                c.qkv_bias = ly.qkv_bias.data_ptr()
            if (ly.q_norm is None) != (ly.k_norm is None):
                raise KernelInputError(f"DecodeStack: layer {i} has a q_norm or a k_norm without the other")
            if ly.q_norm is not None:
                _dense(f"layer {i} q_norm", ly.q_norm, (head_dim,))
                _dense(f"layer {i} k_norm", ly.k_norm, (head_dim,))
                c.q_norm, c.k_norm = ly.q_norm.data_ptr(), ly.k_norm.data_ptr()
            c.in_norm, c.post_norm = ly.in_norm.data_ptr(), ly.post_norm.data_ptr()
            c.k_cache, c.v_cache = ly.k_cache.data_ptr(), ly.v_cache.data_ptr()
            self._keep += [ly.in_norm, ly.post_norm, ly.qkv_bias, ly.q_norm, ly.k_norm, ly.k_cache, ly.v_cache]
        m = self._model = _Model(n_layers=len(layers), hidden=hidden, heads=num_heads, kv_heads=kv_heads,
                                 head_dim=head_dim, inter=inter, slots=slots, block_size=block_size,
                                 positions=positions, mode=_MODES[mode], max_rows=max_rows, many=_MANY[many],
                                 panel_m=quant.PANEL_M, outer_rows=int8_outer_rows[0], outer_rows_q4=int8_outer_rows[1],
                                 kv_bf16=int(first.k_cache.dtype == torch.bfloat16),
                                 moe_experts=max((e.experts.num_experts for e in moes), default=0),
                                 moe_top_k=max((e.top_k + (e.shared.num_experts if e.shared else 0) for e in moes),
                                               default=0),
                                 moe_inter=max((e.experts.inter for e in moes), default=0),
                                 mla_r=entry - mla.rope if mla else 0, mla_rope=mla.rope if mla else 0,
                                 mla_nope=mla.nope if mla else 0, mla_v=mla.v if mla else 0,
                                 mla_q_lora=mla.q_a.n if mla and mla.q_b is not None else 0, eps=eps,
                                 scale=head_dim**-0.5, cos=cos.data_ptr(), sin=sin.data_ptr(),
                                 final_norm=final_norm.data_ptr(), layers=self._layers)
        self._work = torch.empty(lib.di_decode_stack_work_bytes(ctypes.byref(m)), dtype=torch.uint8)
        m.work = self._work.data_ptr()
        self._ref = ctypes.byref(m)
        self._call = lib.di_decode_stack
        self.num_layers, self.hidden, self.max_rows, self.mode, self.many = len(layers), hidden, max_rows, mode, many

    def _bind_mla(self, i: int, a: StackMla, hidden: int, heads: int, entry: int, first: StackMla) -> _Mla:
        r, qk = entry - a.rope, a.nope + a.rope
        if (a.nope, a.rope, a.v, a.q_b is None) != (first.nope, first.rope, first.v, first.q_b is None) or (
                a.q_b is not None and a.q_a.n != first.q_a.n):
            raise KernelInputError(f"DecodeStack: layer {i}'s latent attention differs in shape from layer 0's")
        want = [("q_a", a.q_a, (a.q_a.n if a.q_b is not None else heads * qk, hidden)), ("kv_a", a.kv_a, (entry, hidden))]
        if a.q_b is not None:
            want.append(("q_b", a.q_b, (heads * qk, a.q_a.n)))
        if len(a.uk) != heads or len(a.uv) != heads:
            raise KernelInputError(f"DecodeStack: layer {i}: {len(a.uk)} / {len(a.uv)} absorbed projections for {heads} heads")
        want += [(f"uk[{h}]", w, (r, a.nope)) for h, w in enumerate(a.uk)]
        want += [(f"uv[{h}]", w, (a.v, r)) for h, w in enumerate(a.uv)]
        for name, w, shape in want:
            if not isinstance(w, native.PackedWeight) or w.gated or _shape(w) != shape:
                raise KernelInputError(f"DecodeStack: layer {i} latent {name} must be ungated panels {shape}, got "
                                       f"{_shape(w) if isinstance(w, native.PackedWeight) else type(w).__name__}")
        _dense(f"layer {i} kv_a_norm", a.kv_a_norm, (r,))
        if (a.q_a_norm is None) != (a.q_b is None):
            raise KernelInputError(f"DecodeStack: layer {i}: a q_a norm goes with q_b (both or neither)")
        if a.q_a_norm is not None:
            _dense(f"layer {i} q_a_norm", a.q_a_norm, (a.q_a.n,))
        uk, uv = (_W * heads)(), (_W * heads)()
        c = _Mla(uk=uk, uv=uv, interleave=int(a.interleave), q_a_eps=a.q_a_eps, kv_a_eps=a.kv_a_eps, scale=a.scale,
                 kv_a_norm=a.kv_a_norm.data_ptr(), q_a_norm=a.q_a_norm.data_ptr() if a.q_a_norm is not None else None)
        self._keep += [_bind_weight(c.q_a, a.q_a), _bind_weight(c.kv_a, a.kv_a), a.kv_a_norm, a.q_a_norm, uk, uv, c]
        if a.q_b is not None:
            self._keep.append(_bind_weight(c.q_b, a.q_b))
        for h in range(heads):
            self._keep += [_bind_weight(uk[h], a.uk[h]), _bind_weight(uv[h], a.uv[h])]
        return c

    def _bind_moe(self, i: int, e: StackMoe, hidden: int) -> _Moe:
        p, r = e.experts, e.router
        E = p.num_experts
        if r is None and (E, e.top_k) != (1, 1):
            raise KernelInputError(f"DecodeStack: layer {i}: a dense MLP on the expert kernel is one expert, "
                                   f"top_k 1; got {E} experts, top_k {e.top_k}")
        if p.hidden != hidden or (r is not None and (r.gated or (r.n, r.k) != (E, hidden))):
            raise KernelInputError(f"DecodeStack: layer {i} MoE: router {None if r is None else [r.n, r.k]} and "
                                   f"experts [{E} x {p.inter} x {p.hidden}] do not fit hidden {hidden}")
        if e.scoring not in moe_route.SCORINGS or e.group_score not in moe_route.GROUP_SCORES:
            raise KernelInputError(f"DecodeStack: layer {i} MoE: scoring {e.scoring!r} / group score {e.group_score!r}")
        if not 0 < e.top_k <= E or e.n_group < 1 or E % e.n_group or not 0 < e.topk_group <= e.n_group:
            raise KernelInputError(f"DecodeStack: layer {i} MoE: top_k={e.top_k}, n_group={e.n_group}, "
                                   f"topk_group={e.topk_group} do not fit {E} experts")
        if e.score_bias is not None:
            _dense(f"layer {i} score_bias", e.score_bias, (E,))
        x = e.shared
        if x is not None and (r is None or (x.hidden, x.inter, x.weights, x.bf16_dot) != (p.hidden, p.inter, p.weights, p.bf16_dot)):
            raise KernelInputError(f"DecodeStack: layer {i} MoE: the shared expert's chunks [{x.num_experts} x {x.inter} x "
                                   f"{x.hidden}] are not stacks of the routed experts' shape and storage")
        g = e.shared_gate
        if g is not None and (x is None or not isinstance(g, native.PackedWeight) or g.gated or (g.n, g.k) != (1, hidden)):
            raise KernelInputError(f"DecodeStack: layer {i} MoE: a shared-expert gate must be [1 x {hidden}] panels "
                                   f"of a layer with a shared expert, got {type(g).__name__} "
                                   f"{[getattr(g, 'n', None), getattr(g, 'k', None)]}")
        c = _Moe(experts=E, top_k=e.top_k, inter=p.inter,
                 kind=_EXPERTS[moe_gemm.experts_kernel(p)],
                 scoring=moe_route.SCORINGS.index(e.scoring), n_group=e.n_group, topk_group=e.topk_group,
                 group_score=moe_route.GROUP_SCORES.index(e.group_score), norm=int(e.norm),
                 eps=1e-20 if e.scoring == "sigmoid" else 0.0, scale=float(e.scale),  # (moe_route.route's eps)
                 gate_up=p.gate_up.data_ptr(), down=p.down.data_ptr(),
                 score_bias=e.score_bias.data_ptr() if e.score_bias is not None else None,
                 shared=x.num_experts if x is not None else 0,
                 shared_gate_up=x.gate_up.data_ptr() if x is not None else None,
                 shared_down=x.down.data_ptr() if x is not None else None)
        self._keep += [_bind_weight(c.router, r) if r is not None else None, p.gate_up, p.down, e.score_bias, c,
                       x.gate_up if x is not None else None, x.down if x is not None else None,
                       _bind_weight(c.shared_gate, g) if g is not None else None]
        return c

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 num_layers: int | None = None) -> torch.Tensor:
        """x [M, hidden] fp32; positions, slots int64 [M]; block_tables int64 [M, max_blocks] (row t's
        cache blocks; its token at positions[t] attends to positions 0..positions[t]). Writes each row's
        K and V to its slot in every layer run; returns the hidden states after the final norm.
        num_layers: run only the first that many layers (then the final norm)."""
        m = x.shape[0]
        if (x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or x.shape[1] != self.hidden
                or not 0 < m <= self.max_rows):
            raise KernelInputError(f"DecodeStack: x must be contiguous float32 [M <= {self.max_rows}, {self.hidden}], "
                                   f"got {x.dtype} {tuple(x.shape)}")
        for name, t in (("positions", positions), ("slots", slots), ("block_tables", block_tables)):
            if t.dtype != torch.int64 or not t.is_contiguous() or t.shape[0] != m or t.dim() != 1 + (name == "block_tables"):
                raise KernelInputError(f"DecodeStack: {name} must be contiguous int64 with {m} rows")
        out = torch.empty(m, self.hidden, dtype=torch.float32)
        rc = self._call(self._ref, self.num_layers if num_layers is None else num_layers, x.data_ptr(), m,
                        positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                        out.data_ptr())
        if rc:
            raise KernelInputError(f"DecodeStack: {_ERRORS.get(rc, f'error {rc}')}")
        return out
