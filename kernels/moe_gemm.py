"""The routed experts of an MoE layer as one native grouped GEMM pair on CPU (csrc/moe_gemm.c, built
with the other native kernels by `native.load`).

`pack_experts` lays the stacked expert weights out once (panels of `panel_width()` columns);
`moe_experts(x, idx, packed)` returns [T, k, H]: row (t, j) is expert idx[t, j]'s gated MLP on
x[t], computed in one call (a counting sort by expert, every active expert's gate/up GEMM with silu
* mul in registers, then its down GEMM written to the pair's row). `moe_experts_reference` is the
torch definition. Given the routing weights it also combines the slots in the same call ([T, H]:
products rounded, summed in slot order, + an optional addend: torch's combine, bit for bit), and an
`extra` stack (a shared expert's chunks) runs as expert ids past the stack's.
`pack_experts_bf16_dot` packs for bf16 dot products instead (Engine(dtype="bfloat16"): csrc/gemm_bf16dot.c's
di_moe_experts_bf16dot, the dense bf16-dot GEMM's tiles per expert group, same call and combine).
Each output element is one multiply-add chain over k in order, so a pair's result
does not depend on which other tokens share its expert (batch-invariant).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import huge_pages, native
from .errors import KernelInputError


def _configure(lib) -> None:
    i64, fp = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.di_moe_experts_f32, lib.di_moe_experts_bf16, lib.di_moe_experts_bf16dot):
        fn.argtypes = [fp, i64, i64, i64, fp, i64, fp, fp, i64, fp, fp, i64, i64, fp, fp, i64, fp, fp, i64, fp, i64]
        fn.restype = ctypes.c_int
    lib.di_moe_nr.restype = ctypes.c_int
    lib.di_moe_set_dynamic.argtypes = [ctypes.c_int]
    lib.di_moe_set_dynamic.restype = None
    lib.di_moe_set_prefetch_next.argtypes = [ctypes.c_int]
    lib.di_moe_set_prefetch_next.restype = None
    lib.di_bf16dot_set_tall.argtypes = [ctypes.c_int]
    lib.di_bf16dot_set_tall.restype = None


def _lib():
    return native.require(_configure)


def available() -> bool:
    return native.available()


def panel_width() -> int:
    """Output columns per packed panel (16 with AVX-512, 8 otherwise: one vector register)."""
    return int(_lib().di_moe_nr())


def set_dynamic_schedule(on: bool) -> None:
    """Threads take the kernels' items dynamically (the default) or in equal static blocks; for
    side-by-side measurements (benchmarks/moe_kernels.py). The bits are the same either way."""
    _lib().di_moe_set_dynamic(1 if on else 0)


def set_prefetch_next(on: bool) -> None:
    """The last row tile of a group prefetches the next k block / panel (the default) or, like the
    others, PF_BYTES ahead in its own; for side-by-side measurements. The bits are the same."""
    _lib().di_moe_set_prefetch_next(1 if on else 0)


def set_bf16_dot_tall(on: bool) -> None:
    """bf16-dot experts: a group of 9 .. 32 rows on the tall tile (the default) or on the 8 x 48 tile
    like the others; for side-by-side measurements and tests. The bits are the same either way."""
    _lib().di_bf16dot_set_tall(1 if on else 0)


@dataclass(frozen=True)
class PackedExperts:
    """E experts' weights in panels: gate_up [E, 2P_I, H, NR] (gate and up panels interleaved),
    down [E, P_H, I, NR], float32 or bfloat16 (`weights`). bf16_dot: bf16 pair panels of 16 columns
    instead (rows k and k + 1 of a column side by side, K padded to even with zeros: gate_up
    [E, 2P_I, ceil(H/2), 16, 2], gate and up panels interleaved, down [E, P_H, ceil(I/2), 16, 2]),
    run as bf16 dot products."""

    gate_up: torch.Tensor
    down: torch.Tensor
    num_experts: int
    hidden: int
    inter: int
    bf16_dot: bool = False

    @property
    def weights(self) -> torch.dtype:
        return self.gate_up.dtype


WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def _panels(w: torch.Tensor, nr: int, pairs: bool = False) -> torch.Tensor:
    """[E, N, K] -> [E, ceil(N / nr), K, nr], zero-padded past N; pairs (bf16 dot products):
    [E, ceil(N / nr), ceil(K / 2), nr, 2], rows k and k + 1 of each column side by side, K padded to even."""
    e, n, k = w.shape
    p = -(-n // nr)
    if p * nr != n:
        w = torch.cat([w, w.new_zeros(e, p * nr - n, k)], 1)
    if not pairs:
        return w.reshape(e, p, nr, k).transpose(2, 3).contiguous()
    if k % 2:
        w = torch.cat([w, w.new_zeros(e, p * nr, 1)], 2)
    return w.reshape(e, p, nr, -1, 2).transpose(2, 3).contiguous()


def _rows(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """_panels' inverse (either layout): [E, n, k] in the panels' dtype."""
    e, p, _, nr = panels.shape[:4]
    return panels.transpose(2, 3).reshape(e, p * nr, -1)[:, :n, :k]


BF16_DOT_PANEL = 16  # columns of a bf16-dot expert panel (csrc/gemm_bf16dot.c, EW)


def _check_stack(name: str, w: torch.Tensor) -> None:
    if not isinstance(w, torch.Tensor) or w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 3:
        raise KernelInputError(f"pack_experts: {name} must be a float32 CPU tensor [E, N, K], got "
                               f"{getattr(w, 'dtype', type(w).__name__)} {tuple(getattr(w, 'shape', ()))}")


def _check_pair(fn: str, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int, int]:
    """(E, 2I, H) of a gate_up [E, 2I, H] / down [E, H, I] pair of fp32 CPU stacks; KernelInputError else."""
    _check_stack("gate_up", gate_up)
    _check_stack("down", down)
    e, i2, h = gate_up.shape
    if i2 % 2 or tuple(down.shape) != (e, h, i2 // 2) or e == 0 or h == 0 or i2 == 0:
        raise KernelInputError(f"{fn}: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} are not "
                               "[E, 2I, H] and [E, H, I]")
    return e, i2, h


def pack_experts(gate_up: torch.Tensor, down: torch.Tensor, huge: bool = True,
                 weights: torch.dtype = torch.float32) -> PackedExperts:
    """gate_up [E, 2I, H] (each expert's [gate; up]), down [E, H, I] -> PackedExperts (a copy; huge:
    in memory advised for transparent huge pages, see huge_pages.py). weights=torch.bfloat16 stores
    the panels rounded to bf16 (half the bytes; the kernel widens them to fp32 exactly as it loads
    them, so its result is the fp32 kernel's on the rounded weights, bit for bit)."""
    if weights not in WEIGHT_DTYPES:
        raise KernelInputError(f"pack_experts: weights must be torch.float32 or torch.bfloat16, got {weights}")
    e, i2, h = _check_pair("pack_experts", gate_up, down)
    nr = panel_width()
    i = i2 // 2
    g, u = _panels(gate_up[:, :i], nr), _panels(gate_up[:, i:], nr)
    gu = torch.stack([g, u], 2).flatten(1, 2).contiguous()  # [E, 2P, H, nr]: gate p, up p, ...
    d = _panels(down, nr)
    if weights != torch.float32:
        gu, d = gu.to(weights), d.to(weights)
    if huge:
        gu, d = huge_pages.copy(gu), huge_pages.copy(d)
    return PackedExperts(gu, d, e, h, i)


def pack_experts_bf16_dot(gate_up: torch.Tensor, down: torch.Tensor, huge: bool = True) -> PackedExperts:
    """gate_up [E, 2I, H], down [E, H, I] (fp32) -> PackedExperts for bf16 dot products (bf16_dot=True):
    the weights rounded to bf16 (native.to_bf16_dot) in 16-column pair panels (see PackedExperts: each
    column block one sequential stream for the kernel's tiles), one expert after another.
    `moe_experts` then rounds x, and the gated intermediate, to bf16 and accumulates in fp32
    (csrc/gemm_bf16dot.c, di_moe_experts_bf16dot)."""
    e, i2, h = _check_pair("pack_experts_bf16_dot", gate_up, down)
    i = i2 // 2
    gu16, d16 = native.to_bf16_dot(gate_up), native.to_bf16_dot(down)
    nr = BF16_DOT_PANEL
    gu = torch.stack([_panels(gu16[:, :i], nr, True), _panels(gu16[:, i:], nr, True)], 2).flatten(1, 2).contiguous()
    d = _panels(d16, nr, True)
    if huge:
        gu, d = huge_pages.copy(gu), huge_pages.copy(d)
    return PackedExperts(gu, d, e, h, i, bf16_dot=True)


def unpack_experts(packed: PackedExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 stacks gate_up [E, 2I, H] and down [E, H, I] that `packed` holds (bf16 panels: their
    exact fp32 values), so the packed copy can be the only one kept."""
    i, h, gu = packed.inter, packed.hidden, packed.gate_up  # gate panels at even indices, up panels odd
    gate_up = torch.cat([_rows(gu[:, 0::2], i, h), _rows(gu[:, 1::2], i, h)], 1)
    return gate_up.float().contiguous(), _rows(packed.down, h, i).float().contiguous()


def experts_kernel(packed: PackedExperts) -> str:
    """The library function `moe_experts` runs packed's stacks with (by their storage, or bf16 dot
    products); the decode stack binds the same one."""
    if packed.bf16_dot:
        return "di_moe_experts_bf16dot"
    return "di_moe_experts_bf16" if packed.weights == torch.bfloat16 else "di_moe_experts_f32"


def moe_experts(x: torch.Tensor, idx: torch.Tensor, packed: PackedExperts, extra: PackedExperts | None = None,
                weights: torch.Tensor | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """[T, k, H]: out[t, j] = down_e(silu(gate_e x[t]) * up_e x[t]) for e = idx[t, j]: ids below
    packed.num_experts are packed's experts, the next extra.num_experts (a shared expert's chunks) extra's.

    With weights ([T, k] fp32) the slots are combined in the same call: returns [T, H], row t =
    sum_j weights[t, j] * (expert idx[t, j] on x[t]) in slot order j = 0, 1, ..., then + add[t] (add:
    [T, H] fp32 or None); each product rounded before it is added, so the bits are those of
    `(y * weights[..., None])` summed slot by slot in torch (then `+ add`)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" \
            or x.shape[1] != packed.hidden:
        raise KernelInputError(f"moe_experts: x must be float32 CPU [T, {packed.hidden}], got "
                               f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != x.shape[0] or idx.device.type != "cpu" \
            or idx.dtype not in (torch.int64, torch.int32):
        raise KernelInputError(f"moe_experts: idx must be an integer CPU tensor [{x.shape[0]}, k], got "
                               f"{getattr(idx, 'dtype', type(idx).__name__)} {tuple(getattr(idx, 'shape', ()))}")
    if extra is not None and (extra.hidden, extra.inter, extra.weights, extra.bf16_dot) != \
            (packed.hidden, packed.inter, packed.weights, packed.bf16_dot):
        raise KernelInputError(f"moe_experts: extra experts are {extra.weights} (bf16_dot={extra.bf16_dot}) "
                               f"[H={extra.hidden}, I={extra.inter}], the stack is {packed.weights} "
                               f"(bf16_dot={packed.bf16_dot}) [H={packed.hidden}, I={packed.inter}]")
    if weights is not None and (not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32
                                or weights.device.type != "cpu" or tuple(weights.shape) != tuple(idx.shape)):
        raise KernelInputError(f"moe_experts: weights must be float32 CPU {tuple(idx.shape)}, got "
                               f"{getattr(weights, 'dtype', type(weights).__name__)} {tuple(getattr(weights, 'shape', ()))}")
    if add is not None and (weights is None or not isinstance(add, torch.Tensor) or add.dtype != torch.float32
                            or add.device.type != "cpu" or tuple(add.shape) != (x.shape[0], packed.hidden)):
        raise KernelInputError(f"moe_experts: add must be float32 CPU [{x.shape[0]}, {packed.hidden}] and needs weights, "
                               f"got {getattr(add, 'dtype', type(add).__name__)} {tuple(getattr(add, 'shape', ()))}")
    if x.stride(1) != 1 or x.stride(0) < packed.hidden:
        x = x.contiguous()
    idx = idx.to(torch.int64).contiguous()
    t, k = idx.shape
    y = torch.empty(t, k, packed.hidden, dtype=torch.float32)
    out = torch.empty(t, packed.hidden, dtype=torch.float32) if weights is not None else None
    if t * k == 0:
        return y if out is None else out.zero_().add_(add if add is not None else 0)
    h = torch.empty(t * k, packed.inter, dtype=torch.float32)
    if weights is not None:
        weights = weights.contiguous()
    if add is not None and (add.stride(1) != 1 or add.stride(0) < packed.hidden):
        add = add.contiguous()
    n_extra = extra.num_experts if extra is not None else 0
    lib = _lib()
    fn = getattr(lib, experts_kernel(packed))
    rc = fn(x.data_ptr(), x.stride(0), t, k, idx.data_ptr(), packed.num_experts,
            packed.gate_up.data_ptr(), packed.down.data_ptr(), n_extra,
            extra.gate_up.data_ptr() if extra is not None else None, extra.down.data_ptr() if extra is not None else None,
            packed.hidden, packed.inter, h.data_ptr(), y.data_ptr(), packed.hidden,
            weights.data_ptr() if weights is not None else None, add.data_ptr() if add is not None else None,
            add.stride(0) if add is not None else 0, out.data_ptr() if out is not None else None, packed.hidden)
    if rc == -1:
        n = packed.num_experts + n_extra
        bad = idx[(idx < 0) | (idx >= n)]
        raise KernelInputError(f"moe_experts: expert id {int(bad[0])} out of range [0, {n})")
    if rc != 0:
        raise MemoryError(f"moe_experts: the native kernel could not allocate its sort buffers (code {rc})")
    return y if out is None else out


def moe_experts_reference(x: torch.Tensor, idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The torch definition: [T, k, H] from stacked gate_up [E, 2I, H] and down [E, H, I]."""
    i = down.shape[2]
    gu = torch.einsum("th,tkoh->tko", x, gate_up[idx])
    act = F.silu(gu[..., :i]) * gu[..., i:]
    return torch.einsum("tki,tkhi->tkh", act, down[idx])
    rc = _lib().di_panel_linear_f32(x.data_ptr(), x.stride(0), m, packed.panels.data_ptr(), packed.in_features,
                                    packed.out_features, y.data_ptr(), packed.out_features)
    if rc != 0:
        raise MemoryError(f"linear: the native kernel could not allocate its buffers (code {rc})")
    return y
